"""Product lines (every .py under nanojax/, pallas_kernels/, convert/) by the commit that last wrote them (git blame):
written before SINCE, since then by commits whose subject names a capability added after it, or since then by others.

    python3 scripts/line_shares.py [--since 0d39da9]

The subject match is a keyword list, so a refactor naming a capability counts toward it: read the top commits printed.
"""
import argparse
import collections
import re
import subprocess

CAPABILITIES = re.compile(r"speculat|draft model|structured|constrain|grammar|llguidance|tool call|tool_call|\btools\b|"
                          r"reasoning|response_format|\bmoe\b|expert|mixtral|routing", re.IGNORECASE)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--since", default="0d39da9", help="the commit the shares are counted from")
    args = ap.parse_args()
    after = set(git("rev-list", f"{args.since}..HEAD").split())
    subjects = dict(line.split(" ", 1) for line in git("log", "--format=%H %s", f"{args.since}..HEAD").splitlines())
    files = [f for f in git("ls-files", "nanojax", "pallas_kernels", "convert").split() if f.endswith(".py")]
    shares, by_commit = collections.Counter(), collections.Counter()
    for path in files:
        for line in git("blame", "--line-porcelain", path).splitlines():
            if (m := re.match(r"([0-9a-f]{40}) \d+ \d+", line)) is None:
                continue
            commit = m.group(1)
            if commit not in after:
                shares["before"] += 1
            elif CAPABILITIES.search(subjects[commit]):
                shares["since, capabilities"] += 1
                by_commit[f"{commit[:7]} {subjects[commit][:90]}"] += 1
            else:
                shares["since, other"] += 1
    print(f"{sum(shares.values())} product lines: " + ", ".join(f"{k} {v}" for k, v in shares.items()))
    for label, n in by_commit.most_common(25):
        print(f"{n:5d} {label}")


if __name__ == "__main__":
    main()

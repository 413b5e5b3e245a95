"""scripts/bench_serving.py: scenario parsing, the peer's round-trip tokenizer, and one tiny launch end to end
(nanojax served at two decode-steps values beside its offline rows, then `transformers serve` on the same weights)."""
import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))

import bench_serving
import random_model
from bench_serving import Scenario, parse_scenario
from transformers_serve_peer import prompt_text, save_peer_folder

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 203, "max_position_embeddings": 256, "tie_word_embeddings": True, "eos_token_id": 2}


def test_parse_scenario():
    assert parse_scenario("512,128,1000,-") == Scenario(512, 128, 1000, None, float("inf"))
    assert parse_scenario(" 128, 128, 64, 1 ") == Scenario(128, 128, 64, 1)
    assert parse_scenario("512,128,512,64,20.5") == Scenario(512, 128, 512, 64, 20.5)
    assert parse_scenario("512,128,512,64,20.5").label == "512,128,512,64,20.5"
    assert parse_scenario("16,8,8,-").label == "16,8,8,-,inf"
    for bad in ["512,128,1000", "512,128,1000,-,inf,3", "512,x,1000,-", "0,128,10,-", "5,5,5,0", "5,5,5,-,0",
                "5,5,5,-,-1"]:
        with pytest.raises(argparse.ArgumentTypeError, match="scenario"):
            parse_scenario(bad)


def test_old_flags_make_one_scenario_and_peer_needs_launch(capsys):
    args = bench_serving.parse_args(["--input-len", "9", "--output-len", "3", "--num-prompts", "5"])
    assert args.scenario is None and args.decode_steps == [None]
    args = bench_serving.parse_args(["--scenario", "9,3,5,-", "--scenario", "9,3,5,2", "--decode-steps", "2", "4"])
    assert [s.label for s in args.scenario] == ["9,3,5,-,inf", "9,3,5,2,inf"] and args.decode_steps == [2, 4]
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--scenario", "9,3,5"])
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--peer", "transformers"])
    assert "--peer needs --launch" in capsys.readouterr().err


def test_peer_tokenizer_round_trips_token_ids(tmp_path):
    from transformers import AutoTokenizer

    folder = save_peer_folder(_tiny_hf_model(), tmp_path / "peer")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = [0, 1, 2, 202, 57, 57, 100]
    assert tokenizer(prompt_text(ids))["input_ids"] == ids
    assert tokenizer.all_special_ids == []  # the server's streaming decoder would skip those tokens' text
    assert json.loads((folder / "config.json").read_text()).get("eos_token_id") is None


def _tiny_hf_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = {k: v for k, v in TINY_LLAMA.items() if k != "architectures"}
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(spec.pop("model_type"), **spec))


@pytest.mark.long
def test_tiny_launch_with_the_transformers_peer(tmp_path, monkeypatch):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny-llama.json").write_text(json.dumps(TINY_LLAMA))
    monkeypatch.setattr(random_model, "CONFIGS", tmp_path / "configs")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # --peer sets it when unset: undone after the test
    out = tmp_path / "serving.json"
    report = bench_serving.main([
        "--launch", "tiny-llama", "--scenario", "12,6,5,-", "--scenario", "12,16,3,1", "--decode-steps", "2", "4",
        "--vocab-size", "200", "--max-num-seqs", "5", "--warmup-requests", "1", "--peer", "transformers",
        "--peer-num-prompts", "2", "--peer-timeout", "120", "--peer-args", "--cb-num-blocks 32 --cb-max-batch-tokens 64",
        "--out", str(out), "--save-detailed"])
    assert json.loads(out.read_text()) == report and "peer_error" not in report
    rows = {(r["server"], r["decode_steps"], r["scenario"]): r for r in report["rows"]}
    assert len(rows) == len(report["rows"]) == 2 * 2 * 2 + 2 + 2  # served and offline, the engine rows, the peer
    for steps in (2, 4):
        served, offline = rows["nanojax", steps, "12,6,5,-,inf"], rows["offline", steps, "12,6,5,-,inf"]
        assert (served["completed"], served["failed"], served["total_output_tokens"]) == (5, 0, 30), served["errors"]
        assert offline["total_output_tokens"] == 30 and served["vs_offline"] > 0
        # the engine's own mean TTFT for the same requests: no more than the client's
        assert 0 < served["mean_engine_ttft_ms"] <= served["mean_ttft_ms"]
        sent = [r["sent_s"] for r in served["requests"]]  # --save-detailed: each request, in the order sent
        assert len(sent) == 5 and sent == sorted(sent) and sent[0] >= 0
        assert all(0 < r["ttft_s"] <= r["e2el_s"] and r["output_tokens"] == 6 for r in served["requests"])
        served, step = rows["nanojax", steps, "12,16,3,1,inf"], rows["offline", steps, "12,16,3,1,inf"]
        assert (served["completed"], served["total_output_tokens"]) == (3, 48) and step["decode_ms_per_step"] > 0
        assert served["vs_offline"] == pytest.approx(served["median_tpot_ms"] / step["decode_ms_per_step"])
        engine = rows["engine", steps, "12,16,3,1,inf"]
        assert (engine["completed"], engine["total_output_tokens"]) == (3, 48), engine["errors"]
        assert engine["vs_offline"] == pytest.approx(engine["median_tpot_ms"] / step["decode_ms_per_step"])
    for scenario, output_len in (("12,6,5,-,inf", 6), ("12,16,3,1,inf", 16)):
        peer = rows["transformers", None, scenario]
        assert (peer["num_prompts"], peer["completed"], peer["total_output_tokens"]) == (2, 2, 2 * output_len), \
            peer["errors"]
        assert 0 < peer["median_ttft_ms"] <= peer["median_e2el_ms"]

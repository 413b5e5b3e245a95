"""Serialized executables on disk (nanojax/executable_cache.py): a hit gives what the compiled program gives, a
changed key or an unreadable file compiles again, no directory writes nothing, writers never leave half a file."""
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nanojax import executable_cache as ec
from nanojax.kv_cache import Batch, KVCache


@functools.partial(jax.jit, donate_argnums=(0,))
def _step(cache: KVCache, batch: Batch, scale):
    """A small program shaped like the runner's: a flax.struct cache donated and returned, a Batch of host arrays."""
    k = tuple(c.at[batch.page_table[:, 0]].add(scale * batch.seq_lens[:, None, None, None]) for c in cache.k)
    return k[0][batch.page_table[:, 1]].sum(axis=(1, 2, 3)) * batch.q_lens, cache.replace(k=k)


def _inputs(seed: int):
    rng = np.random.default_rng(seed)
    shape = (7, 2, 4, 8)  # [num_pages, kv_heads, page_size, head_dim]
    cache = KVCache(k=tuple(jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(2)),
                    v=tuple(jnp.zeros(shape) for _ in range(2)))
    batch = Batch(page_table=rng.integers(0, 7, (3, 2)).astype(np.int32),
                  seq_lens=rng.integers(1, 9, 3).astype(np.int32), q_lens=np.array([1, 0, 1], np.int32))
    return cache, batch, np.float32(rng.normal())


@pytest.fixture(autouse=True)
def no_persistent_cache():
    """JAX's persistent compilation cache off (LLM() in an earlier test of this process turns it on, and an executable
    from it is never stored on the CPU), and no executable compiled in memory by an earlier test."""
    from jax.experimental.compilation_cache import compilation_cache

    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    jax.clear_caches()
    yield
    jax.config.update("jax_enable_compilation_cache", before)
    compilation_cache.reset_cache()


@pytest.fixture
def private_xla_cache(tmp_path):
    """JAX's persistent compilation cache in a folder of this test's own (LLM() points it at the user's cache)."""
    from jax.experimental.compilation_cache import compilation_cache

    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    compilation_cache.reset_cache()
    yield tmp_path / "xla"
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
    compilation_cache.reset_cache()


class _Lowerings:
    """The `lower` callable of load_or_compile, counting its calls."""

    def __init__(self, args):
        self.args, self.calls = args, 0

    def __call__(self):
        self.calls += 1
        return _step.trace(*self.args).lower()


def _parts(args, tag="step"):
    return tag, ec.signature(args)


def _run(compiled, seed: int):
    """Runs on fresh inputs; -> (outputs on the host, whether the input cache was donated)."""
    cache, batch, scale = _inputs(seed)
    out, new_cache = compiled(cache, batch, scale)
    return jax.device_get((out, new_cache)), cache.k[0].is_deleted()


def _assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_hit_after_miss_gives_the_same_results_and_still_donates(tmp_path):
    args = _inputs(0)
    lower = _Lowerings(args)
    fresh, hit = ec.load_or_compile(_parts(args), lower, tmp_path)
    loaded, hit_again = ec.load_or_compile(_parts(args), lower, tmp_path)
    assert (hit, hit_again, lower.calls) == (False, True, 1)
    for seed in (1, 2):
        (out_fresh, donated_fresh), (out_loaded, donated_loaded) = _run(fresh, seed), _run(loaded, seed)
        _assert_same(out_fresh, out_loaded)
        assert donated_fresh and donated_loaded


def test_a_changed_key_part_misses(tmp_path):
    args = _inputs(0)
    lower = _Lowerings(args)
    ec.load_or_compile(_parts(args), lower, tmp_path)
    _, hit = ec.load_or_compile(_parts(args, tag="other program"), lower, tmp_path)
    assert not hit and lower.calls == 2
    cache, batch, scale = args
    wider = (cache, batch.replace(page_table=np.zeros((3, 5), np.int32)), scale)
    assert ec.signature(wider) != ec.signature(args)
    _, hit = ec.load_or_compile(_parts(wider), _Lowerings(wider), tmp_path)
    assert not hit


def test_the_environment_picks_the_folder(tmp_path, monkeypatch):
    args = _inputs(0)
    ec.load_or_compile(_parts(args), _Lowerings(args), tmp_path)
    monkeypatch.setattr(ec, "environment", lambda: "another-build")
    _, hit = ec.load_or_compile(_parts(args), _Lowerings(args), tmp_path)
    assert not hit
    assert len(list(tmp_path.glob(f"*/*{ec.SUFFIX}"))) == 2


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "bad executable"])
def test_an_unreadable_file_compiles_again_and_is_replaced(tmp_path, damage):
    args = _inputs(0)
    key = ec.program_key(*_parts(args))
    fresh, _ = ec.load_or_compile(_parts(args), _Lowerings(args), tmp_path)
    path = ec.path_of(tmp_path, key)
    good = path.read_bytes()
    if damage == "bad executable":  # a well-formed file whose executable bytes XLA cannot read
        import pickle

        ids, blob, in_tree, out_tree = pickle.loads(good)
        path.write_bytes(pickle.dumps((ids, blob[: len(blob) // 2], in_tree, out_tree)))
    else:
        path.write_bytes({"garbage": b"\x80\x05not a pickle" * 50, "truncated": good[: len(good) // 2],
                          "empty": b""}[damage])
    lower = _Lowerings(args)
    again, hit = ec.load_or_compile(_parts(args), lower, tmp_path)
    assert not hit and lower.calls == 1
    _assert_same(_run(fresh, 3), _run(again, 3))
    loaded = ec.load(tmp_path, key)  # the file was replaced by a good one
    assert loaded is not None
    _assert_same(_run(fresh, 4), _run(loaded, 4))


def test_no_directory_never_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOJAX_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    args = _inputs(0)
    lower = _Lowerings(args)
    for _ in range(2):
        _, hit = ec.load_or_compile(_parts(args), lower, None)
        assert not hit
    assert lower.calls == 2
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_directory_is_not_an_error(tmp_path):
    args = _inputs(0)
    blocked = tmp_path / "a file"
    blocked.write_text("")
    compiled, hit = ec.load_or_compile(_parts(args), _Lowerings(args), blocked)
    assert not hit and not ec.store(blocked, "key", compiled)
    assert _run(compiled, 1)[1]


def test_concurrent_writers_never_leave_a_partial_file(tmp_path):
    args = _inputs(0)
    key = ec.program_key(*_parts(args))
    compiled = _step.trace(*args).lower().compile()
    expected = _run(compiled, 5)
    path = ec.path_of(tmp_path, key)
    done, seen, errors = threading.Event(), [], []

    def write():
        try:
            for _ in range(15):
                assert ec.store(tmp_path, key, compiled)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    def read():
        while not done.is_set():
            if path.exists():
                seen.append(path.read_bytes())

    writers = [threading.Thread(target=write) for _ in range(2)]
    reader = threading.Thread(target=read)
    reader.start()
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    done.set()
    reader.join()
    assert not errors
    final = path.read_bytes()
    assert seen and all(data == final for data in seen)  # every read saw a whole file
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    _assert_same(_run(ec.load(tmp_path, key), 5), expected)


def test_nothing_is_stored_on_the_cpu_while_the_persistent_cache_is_on(private_xla_cache, tmp_path):
    """Re-serialized, an executable the persistent cache answered loses its fused functions on XLA:CPU, and which
    compile that was cannot be told: with that cache on, nothing is stored; what runs is the same."""
    args = _inputs(0)
    first = ec.compile_and_store(tmp_path / "first", "k", _step.trace(*args).lower())
    assert any(private_xla_cache.iterdir())
    jax.clear_caches()  # the next compile goes to the persistent cache, which answers it
    answered = ec.compile_and_store(tmp_path / "answered", "k", _step.trace(*args).lower())
    assert ec.load(tmp_path / "first", "k") is None and ec.load(tmp_path / "answered", "k") is None
    _assert_same(_run(first, 6), _run(answered, 6))


def test_a_key_part_without_a_stable_repr_is_refused():
    with pytest.raises(ValueError, match="memory address"):
        ec.program_key("step", object())


def test_a_runner_program_loads_bit_identical_and_donates(hf_model_dir, tmp_path):
    """The engine's decode program (KVCache, Batch, SamplingBatch, TokenTables in, Sampled out) through the cache."""
    from nanojax import LLM
    from nanojax.runner import decode_step, greedy_sampling, sampling_batch

    folder, _ = hf_model_dir("qwen3")
    llm = LLM(folder, dtype="float32", page_size=4, max_model_len=32, max_num_seqs=2, max_num_batched_tokens=64,
              kernels="reference", warmup=False)
    runner = llm.runner  # (an LLM collected frees its runner's arrays)
    static = {"config": runner.config, "ops": runner.ops, "num_steps": 3}

    def inputs(seed: int):
        rng = np.random.default_rng(seed)
        cache = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), runner.cache)
        tables = jax.tree.map(jnp.copy, runner.tables)
        batch = Batch(page_table=np.array([[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]], np.int32),
                      seq_lens=np.array([13, 5], np.int32), q_lens=np.array([1, 1], np.int32))
        tokens = rng.integers(0, runner.config.vocab_size, 2).astype(np.int32)
        sampling = sampling_batch(greedy_sampling(2, runner.tables.neutral), 2, runner.tables.neutral)
        prev = jnp.asarray(rng.integers(0, runner.config.vocab_size, 4), jnp.int32)  # the previous dispatch's
        sources = np.array([-1, 2], np.int32)  # row 1 feeds prev[2]
        return runner.params, cache, tables, prev, tokens, batch, sampling, np.array([3, 2], np.int32), sources

    args = inputs(0)
    parts = ("decode_step", static, ec.signature(args))

    def lower():
        return decode_step.trace(*args, **static).lower()

    fresh, _ = ec.load_or_compile(parts, lower, tmp_path)
    loaded, hit = ec.load_or_compile(parts, lower, tmp_path)
    assert hit
    results = []
    for compiled in (fresh, loaded):
        args = inputs(1)
        results.append(jax.device_get(compiled(*args)))
        assert args[1].k[0].is_deleted() and args[2].counts.is_deleted()  # cache and tables donated
    _assert_same(*results)


def test_programs_compile_with_their_gemm_options_on_a_gpu(hf_model_dir, monkeypatch):
    """compile_all hands each program's XLA options to its compile. On a GPU: the programs whose GEMMs have
    CUBLAS_MIN_ROWS rows or more (a decode's rows; a prefill's tokens and its decode rows) take CUBLAS_GEMMS, the
    smaller decodes their decode_tiling, the smaller prefills COST_MODEL_TILING; of FP8 weights the prefills
    COST_MODEL_TILING and the decodes nothing (XLA's tuning); nothing on the CPU."""
    from convert.quantize import quantize_params
    from nanojax import LLM, compilation
    from nanojax import runner as runner_module
    from nanojax.runner import (COST_MODEL_TILING, CUBLAS_GEMMS, CUBLAS_MIN_ROWS, PREFILL_ROW, ModelRunner, Program,
                                decode_tiling)

    folder, _ = hf_model_dir("qwen3")
    llm = LLM(folder, dtype="float32", page_size=4, max_model_len=32, max_num_seqs=2, max_num_batched_tokens=64,
              kernels="reference", warmup=False)
    runner = llm.runner
    one_row = CUBLAS_MIN_ROWS // PREFILL_ROW  # the prefill rows that reach CUBLAS_MIN_ROWS tokens
    small_prefills = (Program(one_row - 1, 0), Program(one_row - 1, 0, decode_rows=PREFILL_ROW - 1))
    large_prefills = (Program(one_row, 0), Program(one_row - 1, 0, decode_rows=PREFILL_ROW),
                      Program(128, 0, decode_rows=256))
    prefills = small_prefills + large_prefills
    small = (Program(1, 8), Program(CUBLAS_MIN_ROWS - 1, 8), Program(64, 8, True))
    large = (Program(CUBLAS_MIN_ROWS, 8), Program(256, 32), Program(256, 32, True))
    others = ("prompt", "set_slot")
    assert all(runner.compiler_options(p) == {} for p in prefills + small + large + others)  # this machine's CPU
    monkeypatch.setattr(runner_module.jax, "default_backend", lambda: "gpu")
    assert all(runner.compiler_options(p) == COST_MODEL_TILING for p in small_prefills)
    assert all(runner.compiler_options(p) == CUBLAS_GEMMS for p in large_prefills + large)
    assert all(runner.compiler_options(p) == decode_tiling(p.rows) for p in small)
    assert all(runner.compiler_options(p) == {} for p in others)
    assert decode_tiling(1) == decode_tiling(8) != decode_tiling(16) != decode_tiling(32) == decode_tiling(64)
    fp8 = object.__new__(ModelRunner)
    fp8.params = quantize_params(jax.device_get(runner.params), llm.config, lm_head=False)
    assert all(fp8.compiler_options(p) == COST_MODEL_TILING for p in prefills)
    assert all(fp8.compiler_options(p) == {} for p in small + large + others)
    monkeypatch.undo()

    marker = {"xla_test_option": 1}
    monkeypatch.setattr(ModelRunner, "compiler_options",
                        lambda self, p: marker if isinstance(p, Program) and not p.num_steps else {})
    given = {}

    def compile_and_store(directory, key, lowered, compiler_options=None):
        given[key] = compiler_options
        return lowered.compile()

    monkeypatch.setattr(ec, "compile_and_store", compile_and_store)
    compilation.compile_all(runner, progress=False, threads=2)
    assert len(given) == len(runner.programs())
    prefills = sum(isinstance(p, Program) and not p.num_steps for p in runner.programs())
    assert sum(o is marker for o in given.values()) == prefills and prefills >= 2
    assert sum(o == {} for o in given.values()) == len(given) - prefills

"""Tensor parallelism: one model over the N devices of a 1-D mesh (axis "tp"), Megatron's layout on jax.sharding.
Each layer runs under `shard_map` on its device's heads: qkv and gate|up split by columns (re-ordered at load so that
device i holds [q_i | k_i | v_i] and [gate_i | up_i]), o and down by rows with an all-reduce after each; KV heads fewer
than the devices are replicated, a MoE layer's experts split whole. The embedding and LM head run per vocabulary shard
too: left to XLA's SPMD partitioner, both all-gathered the weights every step (docs/perf_notes.md)."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm import tqdm

from convert.config import ModelConfig
from nanojax.kv_cache import KVCache
from nanojax.ops import Ops

AXIS = "tp"
_KV_PAGES = P(None, AXIS)  # [num_pages, kv_heads, page_size, head_dim]: split by KV heads


def param_names(path) -> tuple[str, ...]:
    """A params leaf's tree path -> its dict keys (the names `split_axis` and `layout` take; layer indices dropped)."""
    return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))


def split_axis(names: tuple[str, ...], ndim: int) -> int | None:
    """The axis the param at `names` (dict keys from the params' or a layer's root) is split along; None: replicated."""
    if names[0] == "embed" or "experts" in names:
        return 0  # embed [V, H] by vocabulary, experts [E, ...] by expert
    fp8 = names[-1] == "w_t"  # FP8 weights are [N, K] (convert/quantize.py)
    group = names[-2] if len(names) > 1 else None
    if names[0] == "lm_head" or group in ("qkv", "up"):  # by vocabulary or output columns: w [H, N'] (the head's
        return 0 if fp8 else ndim - 1  # [H, V]), w_t [N', H], b and scale [N']
    if group in ("o", "down") and names[-1] in ("w", "w_t"):
        return int(fp8)  # w [q or I, H], w_t [H, q or I]: by input rows; b and scale apply after the all-reduce
    return None


def _spec(axis: int | None) -> P:
    return P() if axis is None else P(*([None] * axis), AXIS)


def param_specs(params):
    """The PartitionSpec of each leaf of `params` (the whole tree, or one layer's)."""
    return jax.tree_util.tree_map_with_path(lambda path, x: _spec(split_axis(param_names(path), np.ndim(x))), params)


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """The layout of `config` over `mesh` (hashable: the compiled steps take it, inside their Ops, as static)."""

    config: ModelConfig
    mesh: Mesh

    @classmethod
    def create(cls, config: ModelConfig, size: int) -> "TensorParallel":
        """Over the first `size` devices of the job; ValueError where the model does not split."""
        devices = jax.devices()
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive int, got {size!r}")
        if size > len(devices):
            raise ValueError(f"tensor_parallel_size={size} but only {len(devices)} devices are available")
        if jax.process_count() > 1 and size != len(devices):  # every process must hold a share of the model
            raise ValueError(f"tensor_parallel_size={size}: a job of {jax.process_count()} processes splits the "
                             f"model over all its {len(devices)} devices")
        if config.num_heads % size:
            raise ValueError(f"num_heads={config.num_heads} is not divisible by tensor_parallel_size={size}")
        kv = config.num_kv_heads
        if max(kv, size) % min(kv, size):
            raise ValueError(f"num_kv_heads={kv} and tensor_parallel_size={size}: one must divide the other "
                             "(KV heads are split, or replicated when fewer than the devices)")
        moe = config.moe  # what each device holds a share of
        splits = ({"num_experts": moe.num_experts, "shared_expert_intermediate_size": moe.shared_size} if moe else
                  {"intermediate_size": config.intermediate_size})
        for name, split in splits.items():
            if split % size:
                raise ValueError(f"{name}={split} is not divisible by tensor_parallel_size={size}")
        return cls(config, Mesh(np.array(devices[:size]), (AXIS,)))

    @property
    def size(self) -> int:
        return self.mesh.size

    @property
    def kv_heads(self) -> int:
        """KV heads of the sharded model: each device holds kv_heads / size of them (replicas when Hkv < size)."""
        return max(self.config.num_kv_heads, self.size)

    @functools.cached_property
    def local_config(self) -> ModelConfig:
        """The model one device runs: its share of the heads and of the intermediate columns, or of the experts."""
        c, n = self.config, self.size
        moe = c.moe and dataclasses.replace(c.moe, num_experts=c.moe.num_experts // n,
                                            shared_size=c.moe.shared_size // n)
        mlp = {"moe": moe} if moe else {"intermediate_size": c.intermediate_size // n}
        return dataclasses.replace(c, num_heads=c.num_heads // n, num_kv_heads=self.kv_heads // n, **mlp)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def ops(self, base: Ops) -> "TensorParallelOps":
        """`base`'s kernels, run per shard."""
        return TensorParallelOps(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, plan=self)

    def place(self, params, progress: bool = False) -> dict:
        """Numpy params -> params on the mesh, each device given only its (re-ordered, padded) slices, one group (top,
        each layer) at a time; params this method placed already are kept, a draft model's (replicated) as they are."""
        top = {k: v for k, v in params.items() if k not in ("layers", "draft")}
        groups = [((), top), *((("layers",), lp) for lp in params["layers"])]
        placed = [jax.tree_util.tree_map_with_path(lambda path, x: self._place_leaf(root + param_names(path), x), group)
                  for root, group in tqdm(groups, desc=f"placing params on {self.size} devices", disable=not progress)]
        return {**placed[0], "layers": tuple(placed[1:]), **{k: v for k, v in params.items() if k == "draft"}}

    def layout(self, names: tuple[str, ...], shape: tuple[int, ...]):
        """Where a tensor of `shape` at param path `names` goes: (placed shape, sharding, _column_index)."""
        axis = split_axis(names, len(shape))
        index = None if axis is None else self._column_index(names, shape[axis])
        placed = tuple(shape) if index is None else (*shape[:axis], len(index), *shape[axis + 1:])
        return placed, NamedSharding(self.mesh, _spec(axis)), index

    def _place_leaf(self, names: tuple[str, ...], src) -> jax.Array:
        if isinstance(src, jax.Array) and getattr(src.sharding, "mesh", None) == self.mesh:
            return src
        src = np.asarray(src)
        shape, sharding, index = self.layout(names, src.shape)
        axis = split_axis(names, src.ndim)

        def block(slices):  # only `axis` is split: the other slices are whole
            if index is None:
                return src[slices]
            sel = index[slices[axis]]
            out = np.take(src, np.maximum(sel, 0), axis=axis)
            out[(slice(None),) * axis + (sel < 0,)] = 0  # vocabulary padding: zero rows / columns
            return out

        return jax.make_array_from_callback(shape, sharding, block)

    def _column_index(self, names: tuple[str, ...], length: int) -> np.ndarray | None:
        """For a split axis of `length`: the source index of each position of the placed axis (-1: zero padding),
        or None where the placed axis is the source axis split in contiguous blocks."""
        c, n = self.config, self.size
        if names[0] in ("embed", "lm_head"):  # the vocabulary padded to a multiple of n
            padded = np.arange(-(-c.vocab_size // n) * n)
            return np.where(padded < length, padded, -1)
        if "qkv" in names:  # [q | k | v] (heads of head_dim columns) -> [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]
            kv_heads = np.arange(self.kv_heads) * c.num_kv_heads // self.kv_heads  # replicated when fewer than n
            blocks = [start + heads.reshape(n, -1, 1) * c.head_dim + np.arange(c.head_dim) for heads, start in
                      ((np.arange(c.num_heads), 0), (kv_heads, c.q_size), (kv_heads, c.q_size + c.kv_size))]
            return np.concatenate([b.reshape(n, -1) for b in blocks], axis=1).ravel()
        if "up" in names and "experts" not in names and c.mlp == "swiglu":  # gate | up: device i gets [gate_i | up_i]
            cols = np.arange(length // 2).reshape(n, -1)
            return np.concatenate([cols, cols + length // 2], axis=1).ravel()
        return None

    def create_cache(self, num_pages: int, page_size: int, dtype, tokens: bool = False,
                     draft: ModelConfig | None = None) -> KVCache:
        """The KV page pools, each device holding its KV heads' pages; the slots' tokens and a draft's on every one."""
        pools = (NamedSharding(self.mesh, _KV_PAGES),) * self.config.num_layers
        shardings = KVCache(pools, pools, self.replicated if tokens else None,
                            None if draft is None else self.replicated)
        config = dataclasses.replace(self.config, num_kv_heads=self.kv_heads)
        return jax.jit(lambda: KVCache.create(config, num_pages, page_size, dtype, tokens, draft),
                       out_shardings=shardings)()


@dataclasses.dataclass(frozen=True)
class TensorParallelOps(Ops):
    """Ops whose decoder layers (`plan.local_config` on each device), embedding lookup and logits run per shard."""

    plan: TensorParallel | None = None

    @property
    def unsharded(self) -> Ops:
        """The same kernels on whole arrays (a draft model, replicated)."""
        return Ops(pallas=self.pallas, interpret=self.interpret)

    def _per_shard(self, fn, in_specs, out_specs):
        return jax.shard_map(fn, mesh=self.plan.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def row_project(self, x, p, *, residual):
        """x: [N, K / size] -> [N, H]: each device's partial products summed, then the bias and the residual."""
        out = jax.lax.psum(self.project(x, p, bias=False), AXIS)
        if p.b is not None:
            out = out + p.b[...].astype(out.dtype)
        return out + residual

    def experts(self, experts, x, weights, ids, residual):
        """Device i runs the rows routed to its experts (i E / size onwards); an all-reduce sums the outputs."""
        first = jax.lax.axis_index(AXIS) * experts.num_experts
        return residual + jax.lax.psum(super().experts(experts, x, weights, ids - first, None), AXIS)

    def run_layer(self, layer, x, positions, cos_sin, slots, k_pages, v_pages, batch, config):
        graphdef, state = nnx.split(layer)

        def local(state, *args):
            return nnx.merge(graphdef, state)(self, *args, self.plan.local_config)

        in_specs = (param_specs(state), P(), P(), P(), P(), _KV_PAGES, _KV_PAGES, P())
        return self._per_shard(local, in_specs, (P(), _KV_PAGES, _KV_PAGES))(
            state, x, positions, cos_sin, slots, k_pages, v_pages, batch)

    def embed(self, table, ids):
        """Each device looks up the ids in its vocabulary rows (zeros for the others); one all-reduce of the [N, H]
        rows sums them exactly (one device's rows are not zero)."""
        def local(table, ids):
            rows = table.shape[0]
            local_ids = ids - jax.lax.axis_index(AXIS) * rows
            inside = (local_ids >= 0) & (local_ids < rows)
            x = jnp.where(inside[:, None], table[jnp.clip(local_ids, 0, rows - 1)], 0)
            return jax.lax.psum(x, AXIS)

        return self._per_shard(local, (P(AXIS), P()), P())(table, ids)

    def sampling_filters(self, logits, s, *, num_top):
        """Ops.sampling_filters per device on the replicated logits: XLA cannot partition a Pallas kernel."""
        local = functools.partial(Ops.sampling_filters, self, num_top=num_top)
        return self._per_shard(local, (P(), P()), P())(logits, s)

    def vocab_head(self, head, hidden):
        """Each device's logits over its vocabulary shard, all-gathered (a few KB per row), the padding cut off."""
        graphdef, state = nnx.split(head)

        def local(state, hidden):
            logits = nnx.merge(graphdef, state)(hidden)
            return jax.lax.all_gather(logits, AXIS, axis=hidden.ndim - 1, tiled=True)

        return self._per_shard(local, (param_specs(state), P()), P())(state, hidden)[..., :self.plan.config.vocab_size]

"""The sharding plan: :func:`shard_model` turns a loaded CPU model into rank r's shard.

What is split (memra/parallel docstring for the canonical order):
- attention: query heads in P canonical parts (and the head gate rows with them); each rank's
  KV heads are those its query heads read, replicated on every rank that needs them (TP larger
  than the KV head count, or parts that cut a GQA group), one K and one V GEMM per KV head; the
  output projection row-parallel over the same head parts. Each rank's KV cache holds its own
  heads (the shard's ``config.layers`` carry the local head counts).
- dense MLP and shared expert: gate/up column-parallel and down row-parallel over P parts of I;
- routed experts: EP (``ctx.expert_parallel``) gives rank r the experts of its canonical parts
  of E, whole; otherwise every expert is split along I like a dense MLP;
- embedding rows and LM head rows (vocabulary) over P parts; norms, q/k norms and the router
  are replicated. Step-3.5's MTP layers stay replicated (each rank runs them whole).

Weights are held dense in the model's compute dtype (the CPU path). A part boundary must fall
on a head, and on a block of the weight's format along the split axis
(:func:`memra.parallel.plan.block_unit`): otherwise ValueError naming the tensor and the reason.
"""

from __future__ import annotations

import dataclasses

import torch

from ..layers.activations import GatedMLP
from ..layers.attention import Attention
from ..layers.moe import MoE
from .group import ParallelContext
from .layers import ColumnParallel, ParallelMoE, RowParallel, VocabParallelEmbedding
from .plan import block_unit, offsets, split_sizes

__all__ = ["shard_model"]


def _dense(linear) -> torch.Tensor:
    if linear.kernel not in ("dense", "int4", "native"):
        raise ValueError(f"shard_model: the layer is on its {linear.kernel!r} path; shard the CPU model before "
                         f"moving it to a device")
    return linear.weight.contiguous()


def _qname(linear, i: int = 0) -> str:
    q = linear.qweights[i] if linear.qweights else None
    return getattr(q, "name", "") or "?"


def _unit(linear, axis: int, part: int = 0) -> int:
    return block_unit(linear.qweights[part], axis) if linear.qweights else 1


def _parts(n: int, ctx: ParallelContext, unit: int, what: str) -> list[tuple[int, int]]:
    sizes = split_sizes(n, ctx.parts, unit, what)
    return list(zip(offsets(sizes), sizes))


def _shard_attention(attn: Attention, ctx: ParallelContext) -> tuple[Attention, object]:
    lc = attn.lc
    H, KV, Dh = lc.num_heads, lc.num_kv_heads, lc.head_dim
    W = _dense(attn.qkv)
    b = attn.qkv.bias
    qo, kvo = H * Dh, KV * Dh
    name = _qname(attn.qkv)
    # heads are the unit; a head's rows must also hold whole row blocks (FP8: 128 rows)
    head_parts = _parts(H, ctx, 1, f"{name}: {H} query heads")
    for p in range(len(attn.qkv.qweights)):
        u = _unit(attn.qkv, 0, p)
        if Dh % u:
            raise ValueError(f"{_qname(attn.qkv, p)}: head_dim {Dh} is not a multiple of the format's {u}-row block: "
                             f"a head split would cut a quantization block")
    mine = [head_parts[p] for p in ctx.owned_parts]
    h0, h1 = mine[0][0], mine[-1][0] + mine[-1][1]
    group = H // KV
    kv_of = [h // group for h in range(h0, h1)]
    kv_list = sorted(set(kv_of))
    hl, kl = h1 - h0, len(kv_list)
    uniform = hl % kl == 0 and all(kv_of[j] == kv_list[j // (hl // kl)] for j in range(hl))
    if not uniform:  # parts cut a GQA group: one (replicated) KV head per query head
        kv_list, kl = kv_of, hl

    def rows(off: int, n: int):
        return W[off:off + n], None if b is None else b[off:off + n]

    blocks = [rows(off * Dh, n * Dh) for off, n in mine]                                  # q, per part
    blocks += [rows(qo + c * Dh, Dh) for c in kv_list]                                    # k, per KV head
    blocks += [rows(qo + kvo + c * Dh, Dh) for c in kv_list]                              # v, per KV head
    if attn.gated:
        blocks += [rows(qo + 2 * kvo + off, n) for off, n in mine]                        # head gate, per part
    qkv = ColumnParallel(blocks, ctx)
    Wo = _dense(attn.o)
    uo = _unit(attn.o, 1)
    if Dh % uo:
        raise ValueError(f"{_qname(attn.o)}: head_dim {Dh} is not a multiple of the format's {uo}-column block: "
                         f"splitting the output projection by heads would cut a quantization block")
    o = RowParallel([Wo[:, off * Dh:(off + n) * Dh] for off, n in mine], ctx, attn.o.bias)
    lc_local = dataclasses.replace(lc, num_heads=hl, num_kv_heads=kl)
    new = Attention(attn.index, lc_local, qkv, o, attn.scale, attn.q_norm, attn.k_norm, attn.gated)
    return new, lc_local


def _shard_gated_mlp(mlp: GatedMLP, ctx: ParallelContext) -> GatedMLP:
    W = _dense(mlp.gate_up)
    i = W.shape[0] // 2
    unit = max(_unit(mlp.down, 1), *(_unit(mlp.gate_up, 0, p) for p in range(len(mlp.gate_up.qweights))), 1)
    parts = _parts(i, ctx, unit, f"{_qname(mlp.down)}: intermediate {i}")
    mine = [parts[p] for p in ctx.owned_parts]
    blocks = [(W[off:off + n], None) for off, n in mine] + [(W[i + off:i + off + n], None) for off, n in mine]
    Wd = _dense(mlp.down)
    down = RowParallel([Wd[:, off:off + n] for off, n in mine], ctx, mlp.down.bias)
    return GatedMLP(ColumnParallel(blocks, ctx), down, mlp.act, mlp.limit, part_sizes=[n for _off, n in mine])


def _shard_moe(moe: MoE, ctx: ParallelContext, hidden: int) -> ParallelMoE:
    ex = moe.experts
    if ex.kernels:
        raise ValueError("shard_model: the routed experts are on their GPU path; shard the CPU model first")
    ex.build()
    gu, dn = ex.w_gate_up, ex.w_down  # [E, 2I, D], [E, D, I]
    e, i2, _ = gu.shape
    i = i2 // 2
    experts = {}
    if ctx.expert_parallel:
        eparts = _parts(e, ctx, 1, f"routed experts: {e} experts")
        for p in ctx.owned_parts:
            off, n = eparts[p]
            for x in range(off, off + n):
                experts[x] = ([gu[x].clone()], [dn[x].clone()])
    else:
        q = ex.qweights[2]
        unit = max(block_unit(q[0] if isinstance(q, list) else q, 1), 1)
        iparts = _parts(i, ctx, unit, f"routed experts: intermediate {i}")
        mine = [iparts[p] for p in ctx.owned_parts]
        for x in range(e):
            experts[x] = ([torch.cat([gu[x, off:off + n], gu[x, i + off:i + off + n]]) for off, n in mine],
                          [dn[x][:, off:off + n].clone(memory_format=torch.contiguous_format) for off, n in mine])
    shared = None if moe.shared is None else _shard_gated_mlp(moe.shared, ctx)
    return ParallelMoE(moe.router, moe.bias, moe.top_k, moe.scaling, experts, ex.limit, shared, ctx, hidden)


def shard_model(model, ctx: ParallelContext):
    """Rank ``ctx.rank``'s shard of ``model`` (a CPU :class:`memra.models.base.CausalLM`, in place:
    the model object becomes the shard and cannot be used unsharded again; returned; each shard
    owns copies of its slices, so the unsharded weights are freed with the model's old modules): the plan in the module docstring. Its ``config.layers`` carry the local head counts
    (what a KV cache for this rank allocates). Works for every model whose layers hold ``attn``
    (:class:`~memra.layers.attention.Attention`) and ``mlp`` (GatedMLP or MoE): llama, qwen2,
    gemma3, step35.

    Raises: ValueError when a split would cut a head or a quantization block (names the tensor),
    when the model is already on a GPU path, or for an unknown layer kind.
    """
    D, V = model.config.hidden_size, model.config.vocab_size
    layer_cfgs = list(model.config.layers)
    for li, layer in enumerate(model.layers):
        if not isinstance(layer.attn, Attention):
            raise ValueError(f"shard_model: layer {li} has no Attention module")
        layer.attn, layer_cfgs[li] = _shard_attention(layer.attn, ctx)
        if isinstance(layer.mlp, MoE):
            layer.mlp = _shard_moe(layer.mlp, ctx, D)
        elif isinstance(layer.mlp, GatedMLP):
            layer.mlp = _shard_gated_mlp(layer.mlp, ctx)
        else:
            raise ValueError(f"shard_model: layer {li}: unknown MLP {type(layer.mlp).__name__}")
    model.config = dataclasses.replace(model.config, layers=layer_cfgs)
    # embedding rows and the LM head by vocabulary parts
    vparts = _parts(V, ctx, 1, f"vocabulary {V}")
    mine = [vparts[p] for p in ctx.owned_parts]
    v0, v1 = mine[0][0], mine[-1][0] + mine[-1][1]
    emb = model.embed
    table = emb.qweight.dequantize(emb.dtype) if emb.qweight.is_quantized else emb.qweight.data.to(emb.dtype)
    head = _dense(model.lm_head)
    model.embed = VocabParallelEmbedding(table[v0:v1].clone(), v0, V, ctx, emb.scale)
    model.lm_head = ColumnParallel([(head[off:off + n], None) for off, n in mine], ctx, full_out=(V, v0))
    model.parallel = ctx
    return model

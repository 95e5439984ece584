"""Pieces every decoder-only model here shares: the model skeleton and weight loading.

A model is ``embed -> layers -> final norm -> LM head``. Each model module (llama.py,
gemma3.py, step3p5.py) only says what its decoder layer computes and which checkpoint
tensors feed it (GGUF through :class:`GGUFWeights`, HF safetensors through :class:`HFWeights`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..config import LayerConfig, ModelConfig
from ..io.gguf import CheckpointError, GGUFCheckpoint
from ..io.safetensors import SafetensorsCheckpoint
from ..layers.device import check_gpu_device, modules_to_gpu, on_device
from ..layers.fused_decode import DecoderLayer, DecoderLayers, native_enabled
from ..layers.linear import NATIVE_MAX_ROWS, Embedding, Linear, head_logits
from ..layers.norm import RMSNorm
from ..layers.rope import rope_cos_sin, rope_key
from ..quant.fp8 import FP8BlockTensor
from ..quant.tensor import QTensor

__all__ = ["CausalLM", "GGUFWeights", "HFWeights", "MODEL_REGISTRY", "on_device", "register_model"]

MODEL_REGISTRY: dict[str, type[CausalLM]] = {}


def register_model(*archs: str):
    """Class decorator: register a :class:`CausalLM` subclass under GGUF architecture names."""
    def deco(cls):
        for a in archs:
            MODEL_REGISTRY[a] = cls
        return cls
    return deco


class GGUFWeights:
    """Typed access to a GGUF checkpoint's tensors with shape checks against the config.

    Every accessor raises :class:`CheckpointError` naming the file, the tensor and the
    config value the expected shape came from.
    """

    def __init__(self, ckpt: GGUFCheckpoint, config: ModelConfig, dtype: torch.dtype,
                 device: torch.device | str | None = None):
        self.ckpt, self.config, self.dtype, self.device = ckpt, config, dtype, device
        self.loaded_bytes = 0

    def q(self, name: str, shape: tuple[int, ...], why: str) -> QTensor:
        """The tensor in its stored format, its bytes on ``device`` (None: host memory)."""
        t = self.ckpt.tensor(name, shape, why=why, device=self.device)
        self.loaded_bytes += t.nbytes
        return t

    def total_bytes(self) -> int:
        """Bytes of every tensor in the checkpoint (the load's total, for progress)."""
        return self.ckpt.total_bytes()

    def vector(self, name: str, n: int, why: str) -> torch.Tensor:
        """A 1-D fp32 tensor of length ``n`` (norm weights, biases)."""
        return self.q(name, (n,), why).dequantize(torch.float32)

    def linear(self, names: list[str], out_sizes: list[int], in_size: int, why: str,
               bias: bool = False) -> Linear:
        """One Linear over the row-concatenation of ``names`` (fused projections)."""
        ws = [self.q(n + ".weight", (o, in_size), why) for n, o in zip(names, out_sizes)]
        b = torch.cat([self.vector(n + ".bias", o, why) for n, o in zip(names, out_sizes)]) if bias else None
        return Linear(ws, b, self.dtype)

    def norm(self, name: str, n: int, why: str) -> RMSNorm:
        return RMSNorm(self.vector(name + ".weight", n, why), self.config.rms_norm_eps)


class HFWeights:
    """Typed access to a HF safetensors checkpoint's tensors, with shape checks against the config.

    Records every tensor it hands out so :meth:`check_all_used` can reject tensors the
    config does not account for (e.g. MTP layers when ``num_nextn_predict_layers`` is 0,
    or expert 16 of a 16-expert config). Every accessor raises :class:`CheckpointError`
    naming the file, the tensor and the config values the expected shape came from.
    """

    def __init__(self, ckpt: SafetensorsCheckpoint, config: ModelConfig, dtype: torch.dtype,
                 device: torch.device | str | None = None):
        self.ckpt, self.config, self.dtype, self.device = ckpt, config, dtype, device
        self.used: set[str] = set()
        self.loaded_bytes = 0

    def __contains__(self, name: str) -> bool:
        return name in self.ckpt

    def total_bytes(self) -> int:
        """Bytes of every tensor in the checkpoint (0 if it cannot say), for progress."""
        total = getattr(self.ckpt, "total_bytes", None)
        return total() if total is not None else 0

    def q(self, name: str, shape: tuple[int, ...], why: str) -> QTensor | FP8BlockTensor:
        """The tensor in its stored format (QTensor, or FP8BlockTensor with its scales)."""
        # in-memory checkpoints (memra/io/synthetic.py) make tensors where they live: no device
        t = self.ckpt.tensor(name, shape, why=why, **({} if self.device is None else {"device": self.device}))
        self.loaded_bytes += t.nbytes
        self.used.add(name)
        if isinstance(t, FP8BlockTensor):
            self.used.add(name + "_scale_inv")
        return t

    def vector(self, name: str, n: int, why: str) -> torch.Tensor:
        """A 1-D fp32 tensor of length ``n`` (norm weights, router bias)."""
        return self.q(name, (n,), why).dequantize(torch.float32)

    def linear(self, names: list[str], out_sizes: list[int], in_size: int, why: str) -> Linear:
        """One Linear over the row-concatenation of ``names`` (+ ``.weight``), e.g. fused q|k|v|g."""
        return Linear([self.q(n + ".weight", (o, in_size), why) for n, o in zip(names, out_sizes)], None, self.dtype)

    def norm(self, name: str, n: int, why: str, zero_centred: bool = True) -> RMSNorm:
        """RMSNorm from ``name.weight``; zero-centred checkpoints store w and the multiplier is 1 + w
        (folded here, in fp32, once)."""
        w = self.vector(name + ".weight", n, why)
        return RMSNorm(w + 1.0 if zero_centred else w, self.config.rms_norm_eps)

    def check_all_used(self) -> None:
        """Raises CheckpointError if the checkpoint holds tensors the model did not load."""
        extra = set(self.ckpt.infos) - self.used
        if extra:
            ex = sorted(extra)
            raise CheckpointError(
                f"{self.ckpt.path}: unexpected tensors for {self.config.arch} with {self.config.num_layers} layers"
                f" and {len(self.config.mtp_layers)} MTP layers (the config does not account for them): "
                f"{ex[:5]}{' ...' if len(ex) > 5 else ''}")


class LoadProgress:
    """A tqdm bar over a load's bytes on stderr (shows GB/s), advanced after each layer from the
    weights source's ``loaded_bytes`` out of its ``total_bytes()``."""

    def __init__(self, w, enabled: bool):
        from tqdm import tqdm

        self.w = w
        self.bar = tqdm(total=w.total_bytes() or None, desc="loading weights", unit="B", unit_scale=True,
                        unit_divisor=1000, disable=not enabled)

    def step(self) -> None:
        self.bar.update(self.w.loaded_bytes - self.bar.n)

    def close(self) -> None:
        self.step()
        self.bar.close()


class CausalLM(nn.Module):
    """Decoder-only LM skeleton.

    Subclasses implement :meth:`build_layer` and may override :meth:`adjust_config`.
    forward(input_ids int64 [T], positions int64 [T], kv) -> final-normed hidden [T, hidden];
    logits(hidden) -> fp32 [T, vocab].

    Decoder layers speak the pre-norm residual stream in the form that lets the add fuse into
    the next norm: ``layer(x, residual, cos, sin, kv) -> (x', residual')`` where the stream after
    the layer is ``x' + residual'`` (``x'``: its last sublayer's output, not yet added) and
    ``residual`` is None for the first layer (vLLM's convention). Each norm then computes
    ``norm.add(x, residual)`` = (rmsnorm(x + residual), x + residual): the same numbers as
    ``x = x + f(norm(x))``, one launch fewer per sublayer on the GPU.
    """

    def __init__(self, config: ModelConfig, embed: Embedding, layers: list[nn.Module], norm: RMSNorm,
                 lm_head: Linear):
        super().__init__()
        self.config = config
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = lm_head
        self._rope_keys = [rope_key(lc) for lc in config.layers]
        self._native: DecoderLayers | None | bool = False  # native_decoder(): False = not built

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv, *, prenorm: bool = False,
                both: bool = False):
        """Run the decoder over ``input_ids`` at ``positions`` through the KV cache ``kv``.

        Returns the final-normed hidden states [T, hidden], or with ``prenorm=True`` the
        residual stream before the final norm (what MTP heads consume; apply ``self.norm``
        to get the former), or with ``both=True`` the pair (final-normed, pre-norm).
        """
        x, residual = self.embed(input_ids), None  # [T, hidden]
        tables = self.rope_tables(positions, x.dtype)
        step = self._native_step(x, kv)
        if step is not None:  # a CPU decode step: every layer in one native call (same bits)
            x, residual = step[0](x, None, *tables[0], step[1])
        else:
            for layer, (cos, sin) in zip(self.layers, tables):
                x, residual = layer(x, residual, cos, sin, kv)
        y, x = self.norm.add(x, residual)
        x = x.to(y.dtype)  # the CPU's fp32 residual stream (memra/layers/norm.py) back in the compute dtype
        return (y, x) if both else x if prenorm else y

    def native_decoder(self) -> DecoderLayers | None:
        """Every decoder layer as one fused native CPU decode step (memra/layers/fused_decode.py
        ``DecoderLayers``), or None where the model's layers are not of a kind it computes (the
        default; Llama-family models override :meth:`native_decoder_layers`). Built once."""
        if getattr(self, "_native", False) is False:
            layers = self.native_decoder_layers() if len(set(self._rope_keys)) == 1 else None
            self._native = None if layers is None else DecoderLayers(layers, self.dtype)
        return self._native

    def native_decoder_layers(self) -> list[DecoderLayer] | None:
        """The decoder layers as :class:`~memra.layers.fused_decode.DecoderLayer` s, or None (the default:
        no fused step)."""
        return None

    def _native_step(self, x: torch.Tensor, kv) -> tuple | None:
        """(the fused decoder, its KV addressing) where this step takes the fused native path: a CPU
        step of at most NATIVE_MAX_ROWS decode rows, kernels enabled, a backend that gives the addressing."""
        if not (x.is_cpu and x.dim() == 2 and x.shape[0] <= NATIVE_MAX_ROWS and native_enabled()):
            return None
        address = getattr(kv, "native_decode", None)
        plan = self.native_decoder() if address is not None else None
        if plan is None or x.dtype != plan.dtype:
            return None
        nkv = address(x.shape[0])
        return None if nkv is None else (plan, nkv)

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per decoder layer, its (cos, sin) tables [T, rotary_dim] at int64 ``positions`` [T];
        layers with equal RoPE settings share one computed pair."""
        tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        for key, lc in zip(self._rope_keys, self.config.layers):
            if key not in tables:
                tables[key] = rope_cos_sin(lc, positions, dtype)
        return [tables[key] for key in self._rope_keys]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head: final-normed hidden [..., hidden] -> fp32 logits [..., vocab]
        (memra/layers/linear.py :func:`~memra.layers.linear.head_logits`)."""
        return head_logits(self.lm_head, hidden)

    def quantize_attention(self, fmt: str) -> int:
        """GPU form only: hold every attention layer's projections (fused QKV(+gate) and output,
        MTP layers' included) in ``fmt``: ``"fp8"`` requantizes bf16 ones to FP8 block 128x128
        (:meth:`~memra.layers.linear.Linear.requantize_fp8`), ``"auto"`` keeps them as loaded.
        Returns the number of weights changed.

        Raises: ValueError for another ``fmt`` or a model not moved to the GPU."""
        from ..layers.attention import Attention

        if fmt == "auto":
            return 0
        if fmt != "fp8":
            raise ValueError(f"attention weights {fmt!r}: supported are 'auto' (as loaded) and 'fp8'")
        n = 0
        for m in self.modules():
            if isinstance(m, Attention):
                n += int(m.qkv.requantize_fp8()) + int(m.o.requantize_fp8())
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the bf16 copies' memory
        return n

    def build_cpu(self, progress: bool = False) -> CausalLM:
        """Build every CPU linear's kernel forms (memra/layers/linear.py ``Linear.build``) and the routed
        experts' dense copies (memra/layers/moe.py ``RoutedExperts.build``) now (otherwise done on first use) so that loading, not the first request, pays for them. ``progress``: a
        tqdm bar over the linear layers on stderr. Returns self."""
        from tqdm import tqdm

        from ..layers.moe import RoutedExperts

        parts = [m for m in self.modules() if isinstance(m, (Linear, RoutedExperts))]
        for m in tqdm(parts, desc="packing CPU weights", unit="layer", disable=not progress):
            m.build()
        return self

    def to_gpu(self, device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16) -> CausalLM:
        """Move the model to a CUDA ``device`` in place and return it.

        Every layer switches to its kernel path (memra/layers/device.py): linear weights keep
        their checkpoint format (memra/layers/linear.py ``pack_for_gpu``; formats without a
        decode kernel are dequantized to bf16), routed experts become expert banks
        (memra/layers/moe.py), the embedding table is held in ``dtype``; norms and routers stay
        fp32. Plain float weights (F32/F16/BF16) are held in bf16 whatever ``dtype`` is (the
        decode kernels' "bf16" format). Compute dtype becomes ``dtype``. Host copies of the
        weights are released. Parts already moved (a model loaded with ``device=``, or built in
        GPU memory) are left as they are.

        Raises: ValueError if ``device`` is not a CUDA device (the CPU is accepted under the
        Triton interpreter, ``TRITON_INTERPRET=1``, so that tests can run this path there).
        """
        self._native = False  # the fused CPU step's weights are the CPU layers'
        modules_to_gpu(self, check_gpu_device(device), dtype)
        return self

    # -------------------------------------------------------------- loading
    @classmethod
    def from_gguf(cls, ckpt: GGUFCheckpoint, config: ModelConfig, dtype: torch.dtype = torch.float32,
                  progress: bool = False, device: torch.device | str | None = None) -> CausalLM:
        """Build the model from a GGUF checkpoint; shapes are checked against ``config``.

        ``progress`` shows a tqdm bar over the bytes on stderr. ``device`` (a CUDA device): the
        tensors' bytes are read straight into its memory (:class:`memra.io.staging.DeviceReader`)
        and each layer is packed there as soon as it is built (memra/layers/device.py), then
        the model is finished with :meth:`to_gpu`.

        Raises:
            CheckpointError: missing tensors or shapes that contradict the config.
        """
        config = cls.adjust_config(ckpt, config)
        w = GGUFWeights(ckpt, config, dtype, device)
        if "rope_freqs.weight" in ckpt:  # read by adjust_config
            w.loaded_bytes += ckpt.infos["rope_freqs.weight"].nbytes
        bar = LoadProgress(w, progress)
        D, V = config.hidden_size, config.vocab_size
        emb_q = w.q("token_embd.weight", (V, D), f"vocab_size={V}, hidden_size={D}")
        embed = Embedding(emb_q, dtype, config.embedding_scale)
        layers = []
        for i in range(config.num_layers):
            layers.append(on_device(cls.build_layer(w, i, config.layers[i]), device, dtype))
            bar.step()
        norm = w.norm("output_norm", D, f"hidden_size={D}")
        head_q = emb_q if config.tie_word_embeddings else w.q("output.weight", (V, D), f"vocab_size={V}, hidden_size={D}")
        bar.close()
        extra = set(ckpt.infos) - w_used(ckpt, config, cls)
        if extra:
            raise CheckpointError(f"{ckpt.path}: unexpected tensors for {config.arch} with {config.num_layers} layers: "
                                  f"{sorted(extra)[:5]}{' ...' if len(extra) > 5 else ''}")
        model = cls(config, embed, layers, norm, Linear(head_q, None, dtype))
        return model if device is None else model.to_gpu(device, dtype)

    @classmethod
    def adjust_config(cls, ckpt: GGUFCheckpoint, config: ModelConfig) -> ModelConfig:
        """Fold config-like tensors (e.g. llama.cpp ``rope_freqs``) into the config."""
        if "rope_freqs.weight" in ckpt:
            full = [lc for lc in config.layers if lc.attention == "full"] or config.layers
            half = full[0].rotary_dim // 2
            f = ckpt.tensor("rope_freqs.weight", (half,), why=f"rotary_dim/2 = {half}").dequantize()
            factors = tuple(float(x) for x in f)
            config = dataclasses.replace(
                config, layers=[dataclasses.replace(lc, rope_freq_factors=factors) if lc.attention == "full" else lc
                                for lc in config.layers])
        return config

    @classmethod
    def build_layer(cls, w: GGUFWeights, i: int, lc: LayerConfig) -> nn.Module:
        raise NotImplementedError

    @classmethod
    def layer_tensor_suffixes(cls, config: ModelConfig) -> list[str]:
        """Names (after ``blk.N.``) of every tensor a layer owns; used to reject unknown tensors."""
        raise NotImplementedError


def w_used(ckpt: GGUFCheckpoint, config: ModelConfig, cls: type[CausalLM]) -> set[str]:
    """Every tensor name a GGUF file of ``cls`` may hold; the loader rejects any other."""
    names = {"token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight"}
    for i in range(config.num_layers):
        names.update(f"blk.{i}.{s}" for s in cls.layer_tensor_suffixes(config))
    return names

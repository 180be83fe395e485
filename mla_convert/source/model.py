"""A functional, layer-streamed forward pass of a Llama-family source model.

Calibration, self-sampling and the converted-layer checks need the source model's activations, but
must not hold the model in memory: a layer's weights are read from the checkpoint when the layer runs
and dropped after.  The math mirrors transformers' Llama/Mistral/Qwen2/Phi-3/SmolLM3 decoder layers exactly
(`tests/test_source_model.py` checks it against them); it is written out here because importing the
transformers modeling stack alone costs ~170 MB of resident memory, a third of SmolLM2's weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import MLAConvertError
from ..io.reader import CheckpointReader
from .config import SourceConfig

EMBED_CHUNK_ROWS = 8192


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm: normalise in fp32, scale in the input dtype."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def default_inv_freq(base: float, dim: int) -> torch.Tensor:
    """The plain RoPE grid, computed with the same float ops as transformers."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def rope_inv_freq(rope_parameters: dict, dim: int) -> torch.Tensor:
    """Inverse frequencies for `dim` rotary dimensions under `rope_parameters` (default/linear/llama3).

    Non-default types go through transformers' own `ROPE_INIT_FUNCTIONS`, fed a minimal
    DeepseekV3Config whose head_dim is `dim`, so source and exported model share one code path.
    """
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        return default_inv_freq(float(rope_parameters["rope_theta"]), dim)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config

    config = DeepseekV3Config(
        hidden_size=dim,
        num_attention_heads=1,
        num_key_value_heads=1,
        qk_rope_head_dim=dim,
        qk_nope_head_dim=0,
        v_head_dim=dim,
        kv_lora_rank=1,
        q_lora_rank=None,
        num_hidden_layers=1,
        first_k_dense_replace=1,
        rope_parameters=dict(rope_parameters),
        max_position_embeddings=int(rope_parameters.get("original_max_position_embeddings", 4096)) * 8,
    )
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
    if scaling != 1.0:
        raise ValueError(f"rope_type {rope_type} scales attention by {scaling}; not supported")
    return inv_freq


def rotary_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (len(positions), 2 * len(inv_freq)) in rotate_half layout, as transformers builds them."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]  # (T, h/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, h)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, shape: SourceConfig,
              layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as layer `layer` of the source attends with them: rotated, unless it is a NoPE layer."""
    if not shape.rotates(layer):
        return q, k
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, T, h); cos/sin: (T, h)."""
    return x * cos + rotate_half(x) * sin


@dataclass(frozen=True)
class StreamedRows:
    """A weight matrix left in its shard and read a block of rows at a time, each block freed after use.

    Why: a layer held whole carried its MLP (0.33 GiB bf16 at Llama-3-8B width) into every later peak of that layer.
    Read as blocks, one block is in memory at a time.
    """

    reader: CheckpointReader
    name: str
    shape: tuple[int, ...]  # (rows, columns)

    def read(self, start: int, stop: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """Rows start:stop as a `dtype` tensor on `device` (safetensors only: the reader's rows are a copy it owns)."""
        return self.reader.get_rows(self.name, start, stop).to(device=device, dtype=dtype)


@dataclass
class SourceLayer:
    """One decoder layer's weights, by role (`q_weight`, `k_bias`, `gate_weight`, `input_norm`, ...).

    Large MLP matrices may be `StreamedRows` (see `StreamedSourceModel.load_layer`); `mlp` and the export read them
    block by block."""

    index: int
    weights: Mapping[str, torch.Tensor | StreamedRows]

    def get(self, role: str) -> torch.Tensor | StreamedRows | None:
        return self.weights.get(role)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def project_qkv(x: torch.Tensor, layer: SourceLayer, shape: SourceConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pre-rotation q, k, v: (batch, heads, T, head_dim) each, from the normalised input x (batch, T, hidden)."""
    batch, length, _ = x.shape
    w = layer.weights
    q = linear(x, w["q_weight"], w.get("q_bias")).view(batch, length, shape.num_heads, shape.head_dim).transpose(1, 2)
    k = linear(x, w["k_weight"], w.get("k_bias")).view(batch, length, shape.num_kv_heads, shape.head_dim).transpose(1, 2)
    v = linear(x, w["v_weight"], w.get("v_bias")).view(batch, length, shape.num_kv_heads, shape.head_dim).transpose(1, 2)
    return q, k, v


def attention_from_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: SourceLayer, shape: SourceConfig
) -> torch.Tensor:
    """Causal GQA attention + o_proj: rotated q (b, H, T, h), k/v (b, G, S, h) -> (b, T, hidden)."""
    causal = q.shape[2] == k.shape[2] and q.shape[2] > 1
    # enable_gqa shares each kv head across its query group without materialising repeated keys
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=shape.head_dim**-0.5, enable_gqa=True)
    batch, _, length, _ = out.shape
    out = out.transpose(1, 2).reshape(batch, length, shape.num_heads * shape.head_dim)  # (b, T, H*h)
    return linear(out, layer.weights["o_weight"], layer.weights.get("o_bias"))


WIDENED_BLOCK_BYTES = 32 * 2**20  # a narrow weight is widened this many bytes of rows at a time (see widened_linear)


def widened_rows(weight: torch.Tensor | StreamedRows, dtype: torch.dtype) -> int:
    """How many rows of `weight` one block holds once widened to `dtype` (see `widened_linear`)."""
    return max(1, WIDENED_BLOCK_BYTES // (weight.shape[1] * torch.empty((), dtype=dtype).element_size()))


def widened_linear(x: torch.Tensor, weight: torch.Tensor | StreamedRows, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` with a weight stored narrower than x (a bf16 MLP matrix) or left in its shard: in blocks of output rows.

    Why blocks: the whole float32 copy of one Llama-3-8B MLP matrix is 235 MB, the largest buffer of the calibration
    pass; a block of rows gives the same products (each output column is one row's dot products) for 32 MB.
    """
    streamed = isinstance(weight, StreamedRows)
    if not streamed and weight.dtype == x.dtype:
        return linear(x, weight, bias)
    rows = weight.shape[0]
    step = widened_rows(weight, x.dtype)

    def block(start: int, stop: int) -> torch.Tensor:  # (stop - start, columns) in x's dtype
        if streamed:
            return weight.read(start, stop, x.dtype, x.device)
        return weight[start:stop].to(x.dtype)

    if step >= rows:
        return linear(x, block(0, rows), None if bias is None else bias.to(x.dtype))
    out = torch.empty(*x.shape[:-1], rows, dtype=x.dtype, device=x.device)  # (..., rows)
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        out[..., start:stop] = linear(x, block(start, stop), None if bias is None else bias[start:stop].to(x.dtype))
    return out


def mlp(x: torch.Tensor, layer: SourceLayer) -> torch.Tensor:
    """The MLP in x's dtype; its weights may be stored narrower (see `load_layer`): each is widened when used."""

    def project(inputs: torch.Tensor, name: str) -> torch.Tensor:
        return widened_linear(inputs, layer.weights[f"{name}_weight"], layer.weights.get(f"{name}_bias"))

    return project(F.silu(project(x, "gate")) * project(x, "up"), "down")


class StreamedSourceModel:
    """The source model run layer by layer from its checkpoint, holding one layer's weights at a time."""

    def __init__(self, reader: CheckpointReader, config: SourceConfig, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", resident_bytes: int = 0):
        self.reader = reader
        self.shape = config
        self.arch = config.architecture
        self.dtype = dtype
        # where the layers compute: weights stream from the shards, one layer on the device at a time ...
        self.device = torch.device(device)
        self.inv_freq = rope_inv_freq(config.rope_parameters, config.head_dim).to(self.device)
        # ... unless a budget lets them stay there.  Sampling calibration text runs every layer and the head once per
        # token, so without it a GPU conversion re-reads and re-uploads the whole checkpoint ~seq_len times.  Kept
        # in the stored dtype, first come first kept; the host (budget 0) keeps the streaming memory bound.
        self.resident_bytes = resident_bytes
        self._resident: dict[str, torch.Tensor] = {}
        self._resident_used = 0

    def _keep(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` on the device in its stored dtype, kept there while the residency budget allows."""
        size = tensor.numel() * tensor.element_size()
        on_device = tensor.to(self.device)
        if self._resident_used + size <= self.resident_bytes:
            if on_device.data_ptr() == tensor.data_ptr():
                on_device = on_device.clone()  # never keep a view into a pickled shard's memory map
            self._resident[name] = on_device
            self._resident_used += size
        return on_device

    def _tensors(self, names) -> dict[str, torch.Tensor]:
        names = list(names)
        missing = [name for name in names if name not in self._resident]
        read = self.reader.get_many(missing) if missing else {}
        return {name: self._resident[name] if name in self._resident else self._keep(name, read[name]) for name in names}

    @property
    def resident_tensor_bytes(self) -> int:
        return self._resident_used

    # ------------------------------------------------------------------ weights
    def release(self) -> None:
        """Close the shard handle (weights already returned are copies, or views that keep a pickled shard's map alive)."""
        self.reader.close()

    def load_layer(self, index: int) -> SourceLayer:
        """One layer's weights on the device: attention and norms in the compute dtype, the MLP as stored.

        The conversion reads the MLP only to run it (`mlp` widens a block of rows at a time) and to copy it to the
        output, so a bf16 checkpoint's MLP is never widened whole (0.66 GiB of the 0.81 GiB an fp32 Llama-3-8B layer
        would hold), and a matrix larger than one block stays in its shard (`StreamedRows`): it is not
        in memory while the layer is converted.  The shard is closed before this returns.
        """
        names = self.shape.layer_weight_names(index)
        mlp_roles = self.shape.mlp_weight_names(index)
        streamed = {role: rows for role, name in mlp_roles.items() if (rows := self._streamed(name)) is not None}
        read = [name for role, name in names.items() if role not in streamed]
        tensors = self._tensors(read) if self.resident_bytes else self.reader.get_many(read)
        layer = {role: streamed[role] if role in streamed else
                 tensors[name].to(device=self.device, dtype=tensors[name].dtype if role in mlp_roles else self.dtype)
                 for role, name in names.items()}
        del tensors
        self.release()
        return SourceLayer(index, layer)

    def _streamed(self, name: str) -> StreamedRows | None:
        """`name` left in its shard when it is a safetensors matrix that spans more than one widened block and no device
        budget keeps it (pickled checkpoints are loaded whole per shard, so re-reading them per block would not pay)."""
        info = self.reader.info(name)
        if (not self.resident_bytes and self.reader.format == "safetensors" and len(info.shape) == 2
                and widened_rows(info, self.dtype) < info.shape[0]):
            return StreamedRows(self.reader, name, info.shape)
        return None

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows for `ids` (any shape), read in row chunks so the full table is never resident."""
        flat = ids.reshape(-1).cpu()
        if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < self.shape.vocab_size:
            raise MLAConvertError(f"token ids {int(flat.min())}..{int(flat.max())} outside the vocabulary "
                                  f"(0..{self.shape.vocab_size - 1})")  # rows left unset would be whatever memory held
        out = torch.empty(flat.numel(), self.shape.hidden_size, dtype=self.dtype, device=self.device)
        rows = self._row_slicer(self.arch.embed)
        for start in range(0, self.shape.vocab_size, EMBED_CHUNK_ROWS):
            stop = min(start + EMBED_CHUNK_ROWS, self.shape.vocab_size)
            inside = (flat >= start) & (flat < stop)
            if inside.any():
                out[inside.to(self.device)] = rows(start, stop).to(device=self.device, dtype=self.dtype)[(flat[inside] - start).to(self.device)]
                self.release()  # (a pickled shard's rows are views of its map: dropped before the next chunk)
        return out.view(*ids.shape, self.shape.hidden_size)

    def _row_slicer(self, name: str):
        """A function (start, stop) -> rows of tensor `name`, reading only those rows (or slicing the kept copy)."""
        if self.resident_bytes and (name in self._resident or self._fits(name)):
            table = self._tensors([name])[name]
            return lambda start, stop: table[start:stop]
        return lambda start, stop: self.reader.get_rows(name, start, stop)

    def _fits(self, name: str) -> bool:
        return self._resident_used + self.reader.info(name).nbytes <= self.resident_bytes

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        name = self.arch.final_norm
        weight = (self._tensors([name])[name] if self.resident_bytes else self.reader.get(name)).to(device=self.device, dtype=self.dtype)
        return rms_norm(hidden, weight, self.shape.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head applied in vocabulary chunks (the head is the largest matrix of small models)."""
        rows = self._row_slicer(self.shape.head_weight_name)
        parts = []
        for start in range(0, self.shape.vocab_size, EMBED_CHUNK_ROWS):
            stop = min(start + EMBED_CHUNK_ROWS, self.shape.vocab_size)
            parts.append(linear(hidden, rows(start, stop).to(device=self.device, dtype=self.dtype)))
            self.release()  # keep one chunk of the (largest) matrix resident at a time
        return torch.cat(parts, dim=-1)

    # ------------------------------------------------------------------ compute
    def cos_sin(self, length: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_cos_sin(self.inv_freq, torch.arange(offset, offset + length, device=self.device), self.dtype)

    def layer_forward(
        self, hidden: torch.Tensor, layer: SourceLayer, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer on full sequences (b, T, hidden); returns (output, normalised attention input)."""
        x = rms_norm(hidden, layer.weights["input_norm"], self.shape.rms_norm_eps)
        q, k, v = project_qkv(x, layer, self.shape)
        q, k = rotate_qk(q, k, cos, sin, self.shape, layer.index)
        hidden = hidden + attention_from_qkv(q, k, v, layer, self.shape)
        hidden = hidden + mlp(rms_norm(hidden, layer.weights["post_attn_norm"], self.shape.rms_norm_eps), layer)
        return hidden, x


def attention_statistics(q: torch.Tensor, k: torch.Tensor, scale: float, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the source's attention goes, from rotated q (b, H, T, h) and k (b, G, T, h).

    Returns (distance, mass): distance (H, T) = summed attention probability at each distance t - s
    (summed over queries and windows, per head); mass (b, T) = attention each key position receives,
    summed over queries and averaged over heads (attention sinks get most of it).
    """
    batch, heads, length, _ = q.shape
    device = q.device
    distance = torch.zeros(heads, length, dtype=torch.float64, device=device)
    mass = torch.zeros(batch, length, dtype=torch.float64, device=device)
    positions = torch.arange(length, device=device)
    back = (positions[:, None] - positions[None, :]).clamp_min(0)  # (T, T): key index t - d for query t
    valid = positions[None, :] <= positions[:, None]  # (T, T): d <= t
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    for b in range(batch):  # one window at a time bounds memory to H x T x T
        keys = k[b].repeat_interleave(group, dim=0)  # (H, T, h)
        scores = torch.einsum("htd,hsd->hts", q[b].float(), keys.float()) * scale
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)  # (H, T, S)
        by_distance = probs.gather(-1, back.expand(heads, length, length)) * valid  # [h, t, d] = probs[h, t, t - d]
        distance += by_distance.sum(1).double()
        mass[b] = probs.sum(1).mean(0).double()
    return distance, mass


def attention_distance_profile(q: torch.Tensor, k: torch.Tensor, scale: float, group: int) -> torch.Tensor:
    """Average attention probability at each distance t - s, per query head: (H, T)."""
    distance, _ = attention_statistics(q, k, scale, group)
    return distance / (q.shape[0] * q.shape[2])


def sequence_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Summed next-token NLL of ids (b, T) under logits (b, T, V)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1), reduction="sum")


__all__ = [
    "StreamedSourceModel",
    "StreamedRows",
    "SourceLayer",
    "rms_norm",
    "apply_rotary",
    "rotate_qk",
    "rotary_cos_sin",
    "rope_inv_freq",
    "attention_distance_profile",
    "project_qkv",
    "attention_from_qkv",
    "mlp",
]

"""A dense DeepseekV3 MLA model held in absorbed form: prefill into, and decode from, a paged latent cache.

The math is that of transformers' `DeepseekV3ForCausalLM` (same norms, same RoPE functions imported
from transformers, same softmax scale), rearranged so that decoding only ever reads the (R + D)-wide
latent cache:

* Keys.  Head h's key is k_h = [W_UK[h] c ; k_rope] with W_UK[h] (nope, R) the key rows of kv_b_proj
  and c the normalised latent, so q_nope[h] . (W_UK[h] c) = (q_nope[h] W_UK[h]) . c.  The query side
  absorbs W_UK: q_latent[h] = q_nope[h] @ W_UK[h] (R values per head), and the score is
  q_latent[h] . c + q_rope[h] . k_rope - what `mla_decode` computes over the cache.
* Values.  v_h = W_UV[h] c, and attention is linear in the values, so
  sum_t p_t v_h,t = W_UV[h] (sum_t p_t c_t): the kernel returns the attention-weighted latent
  (H, R), and W_UV[h] then o_proj map it to the hidden size.

Where W_UK / W_UV live (`absorption.py`): kept as contiguous per-head W_UK (H, nope, R) and W_UV^T
(H, R, v) for batched matmuls, or multiplied into the query / output projections once at load.  Fusing
saves two batched matmuls per layer and step but reads more weights whenever R exceeds nope (resp. v),
so `absorb="auto"` (the default) fuses each side only where it reads no more weights than the separate
form (e.g. SmolLM2 at 4x, R = 64: both sides; at 2x, R = 144: neither).

Per-step overhead (`decode`): the step's host inputs (token ids, positions, cache slots, page-table
rows) go to the device as one packed int64 tensor; the page table is the cache's device table, updated
in place (`PagedLatentCache.device_table`); seq_lens is positions + 1 on the device; the batch's longest
and mean lengths are passed to the kernel as plain numbers (they size its split count, no device read).
On CUDA the whole step is captured once per batch size and length bucket and replayed as a CUDA graph
(`cuda_graphs.py`), which removes the per-kernel launch cost of small batches.

Prefill uses the expanded form instead (keys and values materialised from the prompt's latents, then
ordinary causal attention): its T^2 part costs H*T^2*(nope + D + v) versus H*T^2*(2R + D) absorbed, so
for long prompts with R > nope it is the cheaper form (DeepSeek's own inference splits the same way),
and it is exactly the computation transformers runs.  The latents written to the cache are the same
either way; decode reads only them.

Prompts of different lengths are packed (no padding): all prompt tokens go through the projections and
MLPs as one (N, hidden) matrix, and only the attention runs per sequence, on its own slice.  Nothing
is computed for padding and no mask is needed; the per-sequence attention loop is a handful of calls.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..convert import target as T
from ..source.model import rms_norm
from .absorption import AbsorptionPlan, fuse_output_weight, fuse_query_weight, plan_absorption
from .decode_backends import DecodeAttention, decode_attention
from .errors import GenerationSettingsError, RuntimeModelError
from .generation_settings import GenerationSettings
from .loading import ExportedFolder, compute_dtype, read_exported_folder
from .paged_cache import PagedLatentCache


def causal_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(queries keys^T * scale, causal) values for (H, T, ·) tensors -> (H, T, values' width).

    MLA's query and key heads (nope + D columns) are wider than its value heads (v), and torch's fused CPU
    attention kernel takes one width for all three: given two, scaled_dot_product_attention falls back to its
    unfused path, which materialises every head's (T, T) scores.  On a CPU the values are therefore zero-padded
    to the key width (their extra output columns are zero and dropped; zero query / key columns, where the
    values are the wider, change no score): SmolLM2 2x (112 vs 64 columns, 9 heads), 2048 tokens, one thread,
    0.42 s a layer unpadded against 0.12 s padded (torch 2.13).  On CUDA, where no such run was made, the
    tensors go in as they are.
    """
    length = queries.shape[-2]
    key_width, value_width = keys.shape[-1], values.shape[-1]
    if queries.device.type == "cpu" and key_width != value_width:
        width = max(key_width, value_width)
        queries, keys, values = (t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))
                                 for t in (queries, keys, values))
    out = F.scaled_dot_product_attention(queries[None], keys[None], values[None], is_causal=length > 1,
                                         scale=scale)  # (1, H, T, width)
    return out[0, ..., :value_width]  # (H, T, v)


@dataclass
class AbsorbedAttention:
    """One layer's MLA attention weights, laid out for the absorbed decode (shapes per field)."""

    q_proj: torch.Tensor | None  # (H*(nope+D), hidden), when q_lora_rank is None
    q_a_proj: torch.Tensor | None  # (q_lora_rank, hidden)
    q_a_bias: torch.Tensor | None  # (q_lora_rank,)
    q_a_norm: torch.Tensor | None  # (q_lora_rank,)
    q_b_proj: torch.Tensor | None  # (H*(nope+D), q_lora_rank)
    kv_a_proj: torch.Tensor  # (R + D, hidden)
    kv_a_bias: torch.Tensor | None  # (R + D,)
    kv_a_norm: torch.Tensor  # (R,)
    kv_b_proj: torch.Tensor  # (H*(nope+v), R): the expanded prefill
    w_uk: torch.Tensor  # (H, nope, R): absorbed into the query
    w_uv_t: torch.Tensor  # (H, R, v): applied to the attention-weighted latent
    o_proj: torch.Tensor  # (hidden, H*v)
    o_bias: torch.Tensor | None  # (hidden,)
    q_decode: torch.Tensor | None = None  # (H*(R+D), q_in): W_UK folded into the query projection (decode only)
    o_decode: torch.Tensor | None = None  # (hidden, H*R): W_UV folded into o_proj (decode only)


@dataclass
class DenseLayer:
    input_norm: torch.Tensor  # (hidden,)
    attention: AbsorbedAttention
    post_attention_norm: torch.Tensor  # (hidden,)
    gate_proj: torch.Tensor  # (intermediate, hidden)
    up_proj: torch.Tensor  # (intermediate, hidden)
    down_proj: torch.Tensor  # (hidden, intermediate)


@dataclass(frozen=True)
class AttentionInputs:
    """What one layer's attention needs for N tokens, RoPE already applied."""

    q_nope: torch.Tensor  # (N, H, nope)
    q_rope: torch.Tensor  # (N, H, D), rotated
    latent: torch.Tensor  # (N, R), normalised
    k_rope: torch.Tensor  # (N, D), rotated, shared by all heads

    @property
    def cache_rows(self) -> torch.Tensor:
        return torch.cat([self.latent, self.k_rope], dim=-1)  # (N, R + D): the cache's row layout


class AbsorbedMLAModel:
    """An exported dense DeepseekV3 MLA model in memory, decoding through a `PagedLatentCache`."""

    def __init__(self, folder: ExportedFolder, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, decode_backend: str = "auto", absorb: str = "auto",
                 cuda_graphs: bool | None = None):
        from transformers.activations import ACT2FN
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

        config = folder.config
        self.path = folder.path
        self.config = config
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        from ..devices import device_problems

        problems = device_problems(str(device), flag="device")
        if problems:  # one clear line, not torch's "not compiled with CUDA" assertion at the first tensor
            raise RuntimeModelError("\n".join(problems))
        self.device = torch.device(device)
        self.dtype = compute_dtype(dtype, folder.stored_dtype)
        # what the folder's generation_config.json asks generate() for (a repetition penalty, sampling defaults)
        self.generation_settings = GenerationSettings.from_folder(folder.path)
        # where generate() stops: the generation config's ids when the folder has one (even none), else config.json's
        self.config_eos_token_ids = folder.eos_token_ids
        self.eos_token_ids = (folder.eos_token_ids if self.generation_settings.eos_token_ids is None
                              else self.generation_settings.eos_token_ids)
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.hidden_size = config.hidden_size
        self.rms_norm_eps = config.rms_norm_eps
        self.latent_norm_eps = T.LATENT_NORM_EPS
        self.activation = ACT2FN[config.hidden_act]
        # RoPE and the softmax scale exactly as DeepseekV3RotaryEmbedding / DeepseekV3Attention compute them
        rotary = hf.DeepseekV3RotaryEmbedding(config=config)
        inv_freq, self.attention_scaling = rotary.inv_freq.detach().clone().float(), float(rotary.attention_scaling)
        self.inv_freq = inv_freq.to(self.device)  # (D/2,) fp32
        self.rotate = hf.apply_rotary_pos_emb_interleave if config.rope_interleave else hf.apply_rotary_pos_emb
        self.softmax_scale = float(hf.yarn_apply_mscale(config.rope_parameters, (self.nope_dim + self.rope_dim) ** -0.5))
        self.backend_name = decode_backend
        self.decode_attention: DecodeAttention = decode_attention(decode_backend, self.device)
        q_in = config.hidden_size if config.q_lora_rank is None else config.q_lora_rank
        self.absorption: AbsorptionPlan = plan_absorption(absorb, self.num_heads, self.nope_dim, self.rope_dim,
                                                          self.v_dim, self.kv_lora_rank, q_in, self.hidden_size)
        # CUDA graphs for the decode step: on by default on CUDA (`cuda_graphs.py`); the graphs of each
        # cache are kept with it (weakly, so a finished generation's cache and graphs can be freed).
        self.use_cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
        if self.use_cuda_graphs and self.device.type != "cuda":
            raise GenerationSettingsError(f"CUDA graphs need a CUDA device (device is {self.device})")
        self._graphs = weakref.WeakKeyDictionary()

        tensors = folder.tensors
        take = self._taker(tensors)
        self.embed_tokens = take("model.embed_tokens.weight")  # (vocab, hidden)
        self.final_norm = take("model.norm.weight")  # (hidden,)
        if config.tie_word_embeddings or "lm_head.weight" not in tensors:
            self.lm_head = self.embed_tokens  # tied, as transformers ties them
        else:
            self.lm_head = take("lm_head.weight")  # (vocab, hidden)
        self.layers = [self._load_layer(take, tensors, index) for index in range(self.num_layers)]

    @classmethod
    def from_folder(cls, path: str | Path, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                    decode_backend: str = "auto", absorb: str = "auto",
                    cuda_graphs: bool | None = None) -> AbsorbedMLAModel:
        return cls(read_exported_folder(path), device, dtype, decode_backend, absorb, cuda_graphs)

    # ------------------------------------------------------------------ loading
    def _taker(self, tensors: dict[str, torch.Tensor]):
        def take(name: str, optional: bool = False) -> torch.Tensor | None:
            if name not in tensors:
                if optional:
                    return None
                raise RuntimeModelError(f"{self.path}: tensor {name} is missing from the checkpoint")
            return tensors[name].to(device=self.device, dtype=self.dtype)

        return take

    def _load_layer(self, take, tensors: dict[str, torch.Tensor], index: int) -> DenseLayer:
        prefix = f"model.layers.{index}."
        attn = T.attention_prefix(index)
        heads, nope, v, rank = self.num_heads, self.nope_dim, self.v_dim, self.kv_lora_rank
        if f"{prefix}mlp.gate_proj.weight" not in tensors:
            raise RuntimeModelError(
                f"{self.path}: layer {index} has no dense MLP (mlp.gate_proj.weight); MoE layers are not supported")
        kv_b = take(attn + T.KV_B_PROJ)  # (H*(nope+v), R)
        if kv_b.shape != (heads * (nope + v), rank):
            expected = (heads * (nope + v), rank)
            raise RuntimeModelError(f"{self.path}: layer {index} kv_b_proj is {tuple(kv_b.shape)}, config says {expected}")
        per_head = kv_b.view(heads, nope + v, rank)  # (H, nope+v, R): head h's key rows, then its value rows
        use_q_lora = self.config.q_lora_rank is not None
        attention = AbsorbedAttention(
            q_proj=None if use_q_lora else take(attn + T.Q_PROJ),
            q_a_proj=take(attn + T.Q_A_PROJ) if use_q_lora else None,
            q_a_bias=take(attn + T.Q_A_BIAS, optional=True) if use_q_lora else None,
            q_a_norm=take(attn + T.Q_A_NORM) if use_q_lora else None,
            q_b_proj=take(attn + T.Q_B_PROJ) if use_q_lora else None,
            kv_a_proj=take(attn + T.KV_A_PROJ),
            kv_a_bias=take(attn + T.KV_A_BIAS, optional=True),
            kv_a_norm=take(attn + T.KV_A_NORM),
            kv_b_proj=kv_b,
            w_uk=per_head[:, :nope, :].contiguous(),  # (H, nope, R)
            w_uv_t=per_head[:, nope:, :].transpose(1, 2).contiguous(),  # (H, R, v)
            o_proj=take(attn + T.O_PROJ),
            o_bias=take(attn + T.O_BIAS, optional=True),
        )
        # W_UK / W_UV folded into the projections (absorption.py), in float32 from the stored weights
        stored_per_head = tensors[attn + T.KV_B_PROJ].float().view(heads, nope + v, rank)  # (H, nope+v, R)
        if self.absorption.fuse_query:
            q_weight = tensors[attn + (T.Q_B_PROJ if use_q_lora else T.Q_PROJ)]
            fused = fuse_query_weight(q_weight, stored_per_head[:, :nope, :], nope, self.rope_dim)
            attention.q_decode = fused.to(device=self.device, dtype=self.dtype)  # (H*(R+D), q_in)
        if self.absorption.fuse_output:
            w_uv_t = stored_per_head[:, nope:, :].transpose(1, 2)  # (H, R, v)
            fused = fuse_output_weight(tensors[attn + T.O_PROJ], w_uv_t)
            attention.o_decode = fused.to(device=self.device, dtype=self.dtype)  # (hidden, H*R)
        return DenseLayer(
            input_norm=take(prefix + "input_layernorm.weight"),
            attention=attention,
            post_attention_norm=take(prefix + "post_attention_layernorm.weight"),
            gate_proj=take(prefix + "mlp.gate_proj.weight"),
            up_proj=take(prefix + "mlp.up_proj.weight"),
            down_proj=take(prefix + "mlp.down_proj.weight"),
        )

    # ------------------------------------------------------------------ cache
    def new_cache(self, num_pages: int, page_size: int, max_sequences: int | None = None,
                  max_pages_per_sequence: int | None = None) -> PagedLatentCache:
        """A page pool for this model; the sizes of its device page table are hints (it grows if needed)."""
        return PagedLatentCache(self.num_layers, num_pages, page_size, self.kv_lora_rank, self.rope_dim,
                                self.dtype, self.device, max_sequences, max_pages_per_sequence)

    # ------------------------------------------------------------------ building blocks
    def rope_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (N, D) for absolute positions (N,), computed as DeepseekV3RotaryEmbedding does."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # (N, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (N, D): transformers' layout, the rotation reads what it needs
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(self.dtype), sin.to(self.dtype)

    def query_input(self, x: torch.Tensor, attention: AbsorbedAttention) -> torch.Tensor:
        """What the query projection reads: x itself, or the normalised q_a projection (q_lora models)."""
        if attention.q_proj is not None:
            return x
        return rms_norm(F.linear(x, attention.q_a_proj, attention.q_a_bias), attention.q_a_norm, self.latent_norm_eps)

    def latent_and_key(self, x: torch.Tensor, attention: AbsorbedAttention) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised latent (N, R) and un-rotated shared key (N, D) of x (N, hidden)."""
        compressed = F.linear(x, attention.kv_a_proj, attention.kv_a_bias)  # (N, R + D), in the compute dtype
        latent, k_rope = compressed.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        return rms_norm(latent, attention.kv_a_norm, self.latent_norm_eps), k_rope  # fp32 variance, like transformers

    def attention_inputs(self, x: torch.Tensor, attention: AbsorbedAttention, cos: torch.Tensor,
                         sin: torch.Tensor) -> AttentionInputs:
        """Queries, normalised latent and shared RoPE key of N normalised hidden states x (N, hidden)."""
        count = x.shape[0]
        q_weight = attention.q_proj if attention.q_proj is not None else attention.q_b_proj
        q = F.linear(self.query_input(x, attention), q_weight)
        q = q.view(count, self.num_heads, self.nope_dim + self.rope_dim)  # (N, H, nope + D)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.latent_and_key(x, attention)
        # heads on dim 1 (k as a single head) so transformers' rotation broadcasts cos/sin (N, 1, D/2)
        q_rope, k_rope = self.rotate(q_rope, k_rope[:, None, :], cos, sin, unsqueeze_dim=1)
        return AttentionInputs(q_nope, q_rope, latent, k_rope[:, 0, :])  # k_rope (N, D)

    def mlp(self, x: torch.Tensor, layer: DenseLayer) -> torch.Tensor:
        return F.linear(self.activation(F.linear(x, layer.gate_proj)) * F.linear(x, layer.up_proj), layer.down_proj)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, hidden) last hidden states -> (B, vocab) logits in the compute dtype."""
        return F.linear(rms_norm(hidden, self.final_norm, self.rms_norm_eps), self.lm_head)

    # ------------------------------------------------------------------ prefill
    def expanded_attention(self, inputs: AttentionInputs, attention: AbsorbedAttention, start: int,
                           end: int) -> torch.Tensor:
        """Causal attention of one prompt (tokens start..end of the packed batch) -> (T, H*v)."""
        length = end - start
        heads = self.num_heads
        kv = F.linear(inputs.latent[start:end], attention.kv_b_proj)  # (T, H*(nope+v))
        kv = kv.view(length, heads, self.nope_dim + self.v_dim)  # (T, H, nope + v)
        k_nope, values = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k_rope = inputs.k_rope[start:end, None, :].expand(length, heads, self.rope_dim)  # (T, H, D): shared by heads
        keys = torch.cat([k_nope, k_rope], dim=-1)  # (T, H, nope + D)
        queries = torch.cat([inputs.q_nope[start:end], inputs.q_rope[start:end]], dim=-1)  # (T, H, nope + D)
        out = causal_attention(queries.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                               self.softmax_scale)  # (H, T, ·) each -> (H, T, v)
        return out.transpose(0, 1).reshape(length, heads * self.v_dim)  # (T, H*v)

    @torch.no_grad()
    def prefill(self, cache: PagedLatentCache, seq_ids: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Run the prompts (packed, no padding), store their latents; returns (B, vocab) next-token logits.

        Each prompt attends only to itself, so its sequence must be new (empty in the cache); continuing
        a cached sequence goes through `decode`.
        """
        positions, slots, bounds = [], [], []
        for seq_id, prompt in zip(seq_ids, prompts, strict=True):
            if cache.length(seq_id) != 0:
                raise GenerationSettingsError(
                    f"sequence {seq_id} already holds {cache.length(seq_id)} tokens; prefill starts new sequences only")
            seq_positions, seq_slots = cache.append(seq_id, len(prompt))
            bounds.append((len(positions), len(positions) + len(prompt)))
            positions += seq_positions
            slots += seq_slots
        ids = torch.tensor([token for prompt in prompts for token in prompt], device=self.device)  # (N,)
        positions_t = torch.tensor(positions, device=self.device)  # (N,)
        slots_t = torch.tensor(slots, device=self.device)  # (N,)
        cos, sin = self.rope_cos_sin(positions_t)
        hidden = F.embedding(ids, self.embed_tokens)  # (N, hidden)
        for index, layer in enumerate(self.layers):
            x = rms_norm(hidden, layer.input_norm, self.rms_norm_eps)
            inputs = self.attention_inputs(x, layer.attention, cos, sin)
            cache.write(index, slots_t, inputs.cache_rows)
            attended = torch.cat([self.expanded_attention(inputs, layer.attention, s, e) for s, e in bounds])  # (N, H*v)
            hidden = hidden + F.linear(attended, layer.attention.o_proj, layer.attention.o_bias)
            hidden = hidden + self.mlp(rms_norm(hidden, layer.post_attention_norm, self.rms_norm_eps), layer)
        last = torch.tensor([end - 1 for _, end in bounds], device=self.device)  # (B,)
        return self.logits(hidden[last])

    # ------------------------------------------------------------------ decode
    def decode_queries(self, x: torch.Tensor, attention: AbsorbedAttention, cos: torch.Tensor,
                       sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Absorbed queries of B new tokens: q_latent (B, H, R), rotated q_rope (B, H, D), cache rows (B, R + D)."""
        batch = x.shape[0]
        q_in = self.query_input(x, attention)
        if attention.q_decode is not None:  # W_UK folded in at load: one projection gives q_latent and q_rope
            q = F.linear(q_in, attention.q_decode).view(batch, self.num_heads, self.kv_lora_rank + self.rope_dim)
            q_latent, q_rope = q.split([self.kv_lora_rank, self.rope_dim], dim=-1)  # (B, H, R), (B, H, D)
        else:
            q_weight = attention.q_proj if attention.q_proj is not None else attention.q_b_proj
            q = F.linear(q_in, q_weight).view(batch, self.num_heads, self.nope_dim + self.rope_dim)  # (B, H, nope + D)
            q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
            q_latent = torch.bmm(q_nope.transpose(0, 1), attention.w_uk).transpose(0, 1)  # (H,B,nope)@(H,nope,R) -> (B,H,R)
        latent, k_rope = self.latent_and_key(x, attention)
        q_rope, k_rope = self.rotate(q_rope, k_rope[:, None, :], cos, sin, unsqueeze_dim=1)
        return q_latent, q_rope, torch.cat([latent, k_rope[:, 0, :]], dim=-1)  # cache rows (B, R + D)

    def attention_output(self, out: torch.Tensor, attention: AbsorbedAttention) -> torch.Tensor:
        """(B, H, R) attention-weighted latents -> (B, hidden) through W_UV and o_proj (or their product)."""
        batch = out.shape[0]
        if attention.o_decode is not None:
            return F.linear(out.reshape(batch, self.num_heads * self.kv_lora_rank), attention.o_decode, attention.o_bias)
        values = torch.bmm(out.transpose(0, 1), attention.w_uv_t)  # (H, B, R) @ (H, R, v) -> (H, B, v)
        values = values.transpose(0, 1).reshape(batch, self.num_heads * self.v_dim)  # (B, H*v)
        return F.linear(values, attention.o_proj, attention.o_bias)

    def decode_step(self, cache: PagedLatentCache, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                    page_table: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                    mean_seq_len: float) -> torch.Tensor:
        """One decode step on device tensors only (capturable as a CUDA graph) -> (B, vocab) logits.

        ids, positions, slots (B,) int64; page_table (B, pages) int32; seq_lens (B,) int32 counting the
        new token; max_seq_len / mean_seq_len: the batch's longest / mean length or upper bounds of them.
        """
        cos, sin = self.rope_cos_sin(positions)
        hidden = F.embedding(ids, self.embed_tokens)  # (B, hidden)
        for index, layer in enumerate(self.layers):
            x = rms_norm(hidden, layer.input_norm, self.rms_norm_eps)
            q_latent, q_rope, cache_rows = self.decode_queries(x, layer.attention, cos, sin)
            cache.write(index, slots, cache_rows)
            out, _ = self.decode_attention(
                q_latent, q_rope, cache.layer(index), page_table, seq_lens, self.softmax_scale, self.kv_lora_rank,
                max_seq_len=max_seq_len, mean_seq_len=mean_seq_len,
            )  # out (B, H, R): attention-weighted latent per head
            hidden = hidden + self.attention_output(out, layer.attention)
            hidden = hidden + self.mlp(rms_norm(hidden, layer.post_attention_norm, self.rms_norm_eps), layer)
        return self.logits(hidden)

    @torch.no_grad()
    def decode(self, cache: PagedLatentCache, seq_ids: list[int], tokens: list[int]) -> torch.Tensor:
        """Feed one token per sequence, append its latent to the cache; returns (B, vocab) logits."""
        positions, slots, rows = [], [], []
        for seq_id in seq_ids:
            seq_positions, seq_slots = cache.append(seq_id, 1)
            positions += seq_positions
            slots += seq_slots
            rows.append(cache.row(seq_id))
        max_len = max(positions) + 1  # lengths after the append
        mean_len = sum(positions) / len(positions) + 1
        step_host = torch.tensor([tokens, positions, slots, rows], dtype=torch.int64)  # (4, B)
        if self.use_cuda_graphs:
            from .cuda_graphs import DecodeGraphs

            graphs = self._graphs.get(cache)
            if graphs is None:
                graphs = self._graphs[cache] = DecodeGraphs()
            return graphs.run(self, cache, step_host, max_len, mean_len)
        ids, positions_t, slots_t, rows_t = step_host.to(self.device).unbind(0)  # one host-to-device copy
        pages = -(-max_len // cache.page_size)  # the table's columns the longest sequence uses
        page_table = cache.device_table()[:, :pages].index_select(0, rows_t)  # (B, pages)
        seq_lens = (positions_t + 1).to(torch.int32)  # (B,), counting the new token
        return self.decode_step(cache, ids, positions_t, slots_t, page_table, seq_lens, max_len, mean_len)

"""Measure the KV cache transformers really holds, by counting the tensors of the cache object.

The point of MLA is a smaller cache, and the claim must be measured, not computed from a formula: we
run a forward with `use_cache=True` into a `DynamicCache` and add up the bytes of every tensor its
layers keep.  For a Llama that is K and V per kv head; for stock `DeepseekV3ForCausalLM` (transformers
5.x) the attention pushes the compressed latent `kv_nope` (batch, 1, seq, kv_lora_rank) and the shared
rotary key `k_rot` (batch, 1, seq, qk_rope_head_dim) through `cache.update`, so they sit in the
layer's `keys` / `values` slots.  Walking every tensor attribute of each cache layer (rather than only
`keys`/`values`) keeps the count honest for cache layer types that hold more (quantized caches,
indexer keys).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from ..errors import MLAConvertError


class KVCacheMeasureError(MLAConvertError):
    """The cache could not be measured (no layers, nothing cached, bad arguments)."""


@dataclass(frozen=True)
class KVCacheMeasurement:
    """Bytes held by a cache after `tokens` tokens for `batch_size` sequences."""

    tokens: int
    batch_size: int
    per_layer_bytes: tuple[int, ...]
    bytes_by_attribute: dict[str, int]  # e.g. {"keys": ..., "values": ...}, summed over layers
    dtypes: tuple[str, ...]
    cache_class: str

    @property
    def num_layers(self) -> int:
        return len(self.per_layer_bytes)

    @property
    def total_bytes(self) -> int:
        return sum(self.per_layer_bytes)

    @property
    def bytes_per_token(self) -> float:
        """Bytes per token per sequence, all layers together (the number a memory budget divides by)."""
        return self.total_bytes / (self.tokens * self.batch_size)

    @property
    def bytes_per_token_per_layer(self) -> tuple[float, ...]:
        return tuple(b / (self.tokens * self.batch_size) for b in self.per_layer_bytes)

    def summary(self) -> str:
        """One line: total bytes, bytes per token, per token and layer (a range where layers differ), cache class."""
        from ..units import human_bytes

        per_layer = self.bytes_per_token_per_layer
        low, high = min(per_layer), max(per_layer)
        layer = f"{low:.0f}" if low == high else f"{low:.0f}-{high:.0f}"
        return (f"KV cache {human_bytes(self.total_bytes)} for {self.tokens} tokens x batch {self.batch_size} "
                f"({self.bytes_per_token:.0f} B/token, {layer} B/token/layer over {self.num_layers} layers, "
                f"{', '.join(self.dtypes)}, {self.cache_class})")

    def to_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "batch_size": self.batch_size,
            "cache_class": self.cache_class,
            "dtypes": list(self.dtypes),
            "total_bytes": self.total_bytes,
            "bytes_per_token": self.bytes_per_token,
            "per_layer_bytes": list(self.per_layer_bytes),
            "bytes_by_attribute": dict(self.bytes_by_attribute),
        }


def _tensors_in(value, name: str):
    """(name, tensor) pairs inside an attribute value (tensor, or list/tuple/dict of them)."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item, name)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors_in(item, f"{name}.{key}")


def cache_layer_tensors(layer):
    """The token-holding tensors of one cache layer: every tensor attribute with at least 2 dims.

    0-d/1-d tensors in cache layers are bookkeeping (e.g. a sliding-window length), not per-token data.
    """
    for name, value in vars(layer).items():
        for tensor_name, tensor in _tensors_in(value, name.lstrip("_")):
            if tensor.dim() >= 2:
                yield tensor_name, tensor


def cache_bytes(cache) -> tuple[list[int], dict[str, int], set[str]]:
    """(bytes per layer, bytes per attribute name, dtypes) of everything a transformers cache holds.

    Bytes are those of the underlying storages, each counted once: a slot that is a view into a larger
    preallocated buffer (static caches) costs the whole buffer, which is what the memory really is.
    """
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise KVCacheMeasureError(f"{type(cache).__name__}: not a transformers 5.x cache (no .layers); cannot measure it")
    seen: set[int] = set()
    per_layer: list[int] = []
    by_attribute: dict[str, int] = {}
    dtypes: set[str] = set()
    for layer in layers:
        layer_bytes = 0
        for name, tensor in cache_layer_tensors(layer):
            storage = tensor.untyped_storage()
            if storage.data_ptr() in seen and storage.nbytes() > 0:
                continue
            seen.add(storage.data_ptr())
            layer_bytes += storage.nbytes()
            by_attribute[name] = by_attribute.get(name, 0) + storage.nbytes()
            dtypes.add(str(tensor.dtype).replace("torch.", ""))
        per_layer.append(layer_bytes)
    return per_layer, by_attribute, dtypes


def _cache_kwarg(model) -> str:
    """transformers 5.x renamed `past_key_values` to `cache`; use whichever forward takes."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


@torch.inference_mode()
def measure_kv_cache(model, tokens: int = 128, batch_size: int = 1, input_ids: torch.Tensor | None = None, seed: int = 0) -> KVCacheMeasurement:
    """Run one forward of `tokens` tokens (random ids unless `input_ids` given) into a fresh
    `DynamicCache` and count what it holds.

    Content does not change the cache's size, so random ids are fine; they stay inside the vocabulary.
    """
    from transformers import DynamicCache

    if input_ids is None:
        if tokens < 1 or batch_size < 1:
            raise KVCacheMeasureError(f"tokens and batch size must be positive (got {tokens}, {batch_size})")
        generator = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, model.get_output_embeddings().weight.shape[0], (batch_size, tokens), generator=generator)
    input_ids = torch.as_tensor(input_ids, dtype=torch.long)
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)  # (tokens,) -> (1, tokens)
    batch_size, tokens = input_ids.shape
    device = model.get_input_embeddings().weight.device
    cache = DynamicCache(config=model.config)
    was_training = model.training
    model.eval()
    try:
        kwargs = {_cache_kwarg(model): cache}
        if "logits_to_keep" in inspect.signature(model.forward).parameters:
            kwargs["logits_to_keep"] = 1  # the logits are not needed; skip the vocabulary matmul
        model(input_ids=input_ids.to(device), use_cache=True, **kwargs)
    finally:
        model.train(was_training)
    per_layer, by_attribute, dtypes = cache_bytes(cache)
    if not any(per_layer):
        raise KVCacheMeasureError(f"{type(model).__name__}: the forward cached nothing (does this model support use_cache?)")
    return KVCacheMeasurement(tokens, batch_size, tuple(per_layer), by_attribute, tuple(sorted(dtypes)), type(cache).__name__)


def max_context_for_budget(bytes_per_token: float, budget_bytes: float, batch: int = 1) -> int:
    """Longest context whose cache fits in `budget_bytes` for `batch` sequences (whole tokens)."""
    if bytes_per_token <= 0 or batch < 1:
        raise KVCacheMeasureError(f"bytes per token must be positive and batch at least 1 (got {bytes_per_token}, {batch})")
    if budget_bytes < 0:
        raise KVCacheMeasureError(f"budget must not be negative (got {budget_bytes})")
    return int(budget_bytes // (bytes_per_token * batch))

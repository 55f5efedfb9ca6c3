"""zero-infinity: ZeRO Stage-3 partitioning with tiered offload (device, host, NVMe).

Glossary (the words mean one thing everywhere in this code):

* **shard**: this rank's slice of a flattened, padded parameter (or of its
  optimizer state). Rank ``r`` of ``world_size`` owns elements
  ``[r * shard_numel, (r + 1) * shard_numel)`` of the padded flat tensor.
* **tier**: where bytes rest: ``device`` (the compute device's memory; the CPU
  when there is no GPU), ``host`` (CPU memory, pinned when a GPU is present) or
  ``nvme`` (files written with direct I/O).
* **fetch / release**: make a parameter's full tensor available to compute
  (bring its shard up the tiers and all-gather it) / free that full tensor,
  keeping only the shard.
* **swap in / swap out**: host <-> NVMe transfers.
* **copy**: host <-> device transfers.
* **compute shard**: the shard in compute precision (fp32, bf16 or fp16);
  **master**: the fp32 shard the optimizer updates; **moments**: Adam's
  ``exp_avg`` and ``exp_avg_sq``.
* **sub-group**: a run of whole shards the optimizer updates (and swaps) together.

Public surface::

    engine = infinity.initialize(model, config)   # dict, path to JSON, or InfinityConfig
    engine = infinity.from_pretrained(hf_folder, config)   # a local Hugging Face causal LM, weights streamed in
    out = engine(**batch)                          # the model's own forward: its arguments, its outputs
    engine.backward(out.loss); engine.step()        # (our byte GPT: loss = engine(input_ids, targets))
"""

from infinity.runtime.lazy import lazy_names

__version__ = "0.1.0"

# Imported on first use, so `import infinity` (and `infinity bench`) stays light.
_LAZY = {
    "initialize": ("infinity.engine.engine", "initialize"),
    "from_pretrained": ("infinity.hf.pretrained", "from_pretrained"),
    "Engine": ("infinity.engine.engine", "Engine"),
    "InfinityConfig": ("infinity.config.schema", "InfinityConfig"),
    "Init": ("infinity.engine.materialize", "Init"),
    "TiledLinear": ("infinity.tiling", "TiledLinear"),
    "TiledEmbedding": ("infinity.tiling", "TiledEmbedding"),
    "TiledTiedHead": ("infinity.tiling", "TiledTiedHead"),
}

__all__ = ["__version__", *_LAZY]


__getattr__ = lazy_names(__name__, _LAZY, globals())

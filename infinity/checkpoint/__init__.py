"""Sharded checkpoints: save and resume without losing a bit, reshard to another
world size, consolidate into one state dict.

A checkpoint is a directory ``save_dir/<tag>/``::

    meta.json                           rank 0: everything that is not a tensor (see below)
    shard-00000-of-00002.safetensors    rank 0's shards, its RNG state, the module's buffers
    shard-00001-of-00002.safetensors    rank 1's shards, its RNG state
    save_dir/latest                     the tag of the newest complete checkpoint, written last

Each rank's file is a plain safetensors file holding, for every parameter,
1-D tensors of ``shard_numel`` elements (the rank's slice of the flattened,
zero-padded parameter):

* ``param/<name>``: the compute shard, in compute precision (every parameter; not the frozen ones when saved
  with ``exclude_frozen_parameters``: the header then holds the rank's fingerprint of them, and the checkpoint
  loads only beside the same frozen values at the same world size, :mod:`.frozen`);
* ``master/<name>``, ``exp_avg/<name>``, ``exp_avg_sq/<name>``: fp32 (trainable ones);

plus ``buffer/<name>`` (rank 0 only, full shape) and ``rng/torch`` (uint8,
``rng/cuda`` where there is a GPU). Its header ``__metadata__`` holds the rank,
the world size and the numpy/python RNG states as JSON.

The file is written tensor by tensor (the header first, its offsets computed
from the layout), so a rank's state streams through two sub-group-sized host
buffers from whichever tier holds it; NVMe state is never staged whole in RAM.

``meta.json`` holds the format version, the world size, every parameter's
name, shape, numel, shard size, trainability and aliases (tied names), the
buffers, the tiling plan's dense names, the step counters, the optimizer's
step and lr, the loss scaler, the config, the caller's ``client_state``, the
size and sha256 of every shard file, and a sha256 of its own content.

Loading never unpickles: only JSON and safetensors are read, every shard file
is checked against its recorded size and sha256 before a byte of it is used,
and a checkpoint of another model is refused naming the first tensor that
differs. A checkpoint saved at another world size is resharded on load: each
rank reads its range of every parameter's padded flat from the ranks' files
that hold it. ``save_dir`` must be one filesystem shared by all ranks.

The run is seen through a :class:`~infinity.checkpoint.shard_source.ShardSource` (the
engine builds one), never through the engine itself. One module per job:

* :mod:`.files`: the files' names, ``meta.json`` and its checksum;
* :mod:`.publish`: the atomic publish protocol (staging folder, fsync, rename,
  ``latest``, leftovers of interrupted saves);
* :mod:`.save`: the body of ``meta.json`` and the streaming shard writer;
* :mod:`.reader`: a checkpoint opened for reading, verified, read by range;
* :mod:`.load`: loading into a run (verification, resharding, dtype conversion);
* :mod:`.rng`: the random generators' state.
"""

from infinity.checkpoint.files import FORMAT, META_FILE, VERSION, read_meta
from infinity.checkpoint.load import load_checkpoint
from infinity.checkpoint.publish import LATEST_FILE, read_latest, resolve_checkpoint
from infinity.checkpoint.reader import Checkpoint
from infinity.checkpoint.save import save_checkpoint
from infinity.checkpoint.safetensors_io import CheckpointError

# The names two helpers had when the package was one module (now public in .publish).
from infinity.checkpoint.publish import TMP_PREFIX as _TMP_PREFIX  # noqa: F401
from infinity.checkpoint.publish import fsync_dir as _fsync_dir  # noqa: F401

__all__ = [
    "FORMAT", "LATEST_FILE", "META_FILE", "VERSION", "Checkpoint", "CheckpointError", "load_checkpoint",
    "read_latest", "read_meta", "resolve_checkpoint", "save_checkpoint",
]  # fmt: skip

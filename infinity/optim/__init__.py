"""The optimizer step: the offload optimizer, the step cycle, the overlapped step and its tail, the states in memory and on NVMe."""

"""Writing Megatron-Core `torch_dist` checkpoints (`to-megatron`): the entry, one process's writer, and torchrun ranks."""

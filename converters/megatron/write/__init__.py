"""Writing Megatron-Core `torch_dist` checkpoints (`to-megatron`): the entry (`to_megatron`), one
process's writer (`torch_dist`), and torchrun ranks (`ranks`)."""

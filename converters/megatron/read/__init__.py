"""Reading a Megatron-Core save: the safe unpickler and its bounds, torch's archive format, DCP metadata,
byte sources, record and object layouts in their files, Megatron-LM run directories. No Megatron model
knowledge: `converters.megatron.plan` interprets what is read."""

"""The live adapter a Megatron-LM training loop calls: export / reload of a live model and its
DistributedOptimizer (`adapter`), and the asynchronous save (`async_save`)."""

"""The live adapter a Megatron-LM training loop calls: export / reload of a live model and DistributedOptimizer, and the asynchronous save."""

"""remat inside the tools people train with, each an optional import.

* :mod:`remat.integrations.hf`: ``RematCallback`` for Hugging Face's ``Trainer``;
* :mod:`remat.integrations.lightning`: ``RematCallback`` for Lightning's ``Trainer``;
* :mod:`remat.integrations.fsdp`: per-rank budgets for models sharded with FSDP2.

Importing this package imports none of them (nor transformers, lightning, torch).
"""

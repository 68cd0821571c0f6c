"""handbook_lib: the companion library of the FSDP Handbook.

The vocabulary every module shares (``config``: the run config, dtypes and precisions;
``strategies``: one table of what each strategy shards and how each library spells it), pure
models of what distributed training costs (``architecture``, ``sharding``, ``memory``,
``activations``, ``comm``, ``hardware``, ``presets``, ``planner``), what a rank does to measure
it (``model``, ``distributed``, ``parallelize``, ``training``, ``measure``) and to survive an
interruption (``checkpoint``), experiments launched with torchrun (``runs``, ``launch``), and
the faces a reader uses (``cli``, ``display``, ``plots``). Each module's docstring names the
chapter that teaches it.
"""

__version__ = "0.1.0"

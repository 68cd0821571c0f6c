"""handbook_lib: the companion library of the FSDP Handbook.

Pure models of what distributed training costs (``model``, ``sharding``, ``memory``,
``activations``, ``comm``, ``hardware``), what a rank does to measure it (``distributed``,
``training``, ``measure``) and to survive an interruption (``checkpoint``), experiments launched
with torchrun (``runs``, ``launch``), and the faces a reader uses (``cli``, ``display``,
``plots``). Each module's docstring names the chapter that teaches it.
"""

__version__ = "0.1.0"

"""The PyTorch side of the command line: built-in models (``models``), checkpointing
strategies (``strategies``), FLOP counting and memory readers (``measure``), the runner
that measures and times them (``runner``), the wrapper-overhead timing (``overhead``) and
``recomp bench --tp`` (``tensor_parallel``). Imported in child processes and by
``recomp report``, never by ``import recomp``."""

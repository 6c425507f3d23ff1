"""The MindSpore (PyNative) side of the command line: the built-in decoder (``models``)
and the runner that measures and times its strategies (``runner``). Imported in child
processes and by ``recomp report --framework mindspore``, never by ``import recomp``."""

"""The command line: ``recomp bench``, ``recomp plan``, ``recomp report`` and
``recomp simulate``.

One module per command (``bench``, ``plan``, ``report``, ``simulate``); what they share in modules
named for what it is: the configuration and model options (``config``), the child
processes (``jobs`` starts them, ``worker`` is the child, ``messages`` the typed
messages between the two), measured rows and the JSON file (``results``), tables,
plots and plan predictions (``tables``, ``plots``, ``predictions``), step timing
(``timing``), region counters (``counters``), allocator readings (``memory``) and the
saved-tensor reports (``saved_tensors``). The code that imports a framework lives in
``cli.torch`` and ``cli.mindspore`` (runners, built-in models, strategies) and runs in
child processes, one per measurement, so that the allocator readings of one strategy
never see another's memory.

The planner itself is ``recomp.plan``, a library below this package that never imports
it. Nothing here is imported by ``import recomp``; ``python -m recomp`` loads a command
lazily.
"""

"""The launcher of the whole system, above the packages it starts: the ``kvstore`` command
(``serve``, ``engine``, ``scheduler``, ``up``, ``replay``, ``simulate``) and ``kvstore up``'s
supervisor. ``kvstore/`` (the pool), ``engines/`` and ``scheduler/`` never import it."""

"""The command line (``python -m remat``, the ``remat`` script) and what it writes.

* :mod:`remat.cli.commands`: the commands and their arguments (``main``);
* :mod:`remat.cli.demo`: ``python -m remat demo``, remat's whole job on a reference model;
* :mod:`remat.cli.losses`: ``--loss`` by name;
* :mod:`remat.cli.output`: files checked before the work starts, written whole or not at all;
* :mod:`remat.cli.report`: plain-text tables.

Importing this package imports none of them.
"""

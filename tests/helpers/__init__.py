"""Helpers the test modules import by name. tests/ is on ``sys.path`` in the pytest process (pytest's default
``prepend`` import mode puts the folder of tests/conftest.py there); a subprocess that imports from tests/ needs it on
its ``PYTHONPATH`` (as tests/test_torchrun.py sets it).

- :mod:`helpers.cpu`: the CPU pins under which runs give the same bits, and the platform that can still change them.
- :mod:`helpers.runs`: the tiny model and data the trainer's launches start from, the flags they share, and the
  launches themselves (``python -m megatron_pacs.train``, run to its end or to a refusal).
"""

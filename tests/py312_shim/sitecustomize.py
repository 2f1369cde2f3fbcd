"""Test-only: the few Python 3.12 standard-library names megatron-core 0.17 to 0.19 import, for running their
source on Python 3.11 (put this folder on PYTHONPATH). The plugin itself needs none of them."""
import typing

if not hasattr(typing, "override"):
    def override(method):
        """PEP 698's marker: sets __override__ and changes nothing else, as Python 3.12's does."""
        try:
            method.__override__ = True
        except (AttributeError, TypeError):
            pass
        return method

    typing.override = override

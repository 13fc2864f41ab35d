"""Tiny K3-style model (about 2M parameters): every K3 mechanism, trains on a laptop CPU."""

from k3.config import default_config


def get_config():
    return default_config()  # the schema's defaults are this model

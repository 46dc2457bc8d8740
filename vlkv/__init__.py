"""vlkv: smaller, smarter, shareable KV caches for vision-language models."""

__version__ = "0.1.0"


def generate(*args, **kwargs):
    """Run generation with a KV-cache policy; see :func:`vlkv.runtime.engine.generate`."""
    from vlkv.runtime.engine import generate as _generate

    return _generate(*args, **kwargs)

"""tfscale's contact with Keras and TensorFlow internals: the one registry of every attribute
it replaces (``registry.py``)."""

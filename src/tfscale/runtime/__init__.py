"""What runs when this process imports TensorFlow: the import hook that applies
``TFSCALE_VIRTUAL_DEVICES`` and holds TensorFlow's start-up chatter back. TensorFlow-free.
"""

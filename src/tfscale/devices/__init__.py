"""Devices: discovery, logical (virtual) devices, CUDA_VISIBLE_DEVICES as CUDA reads it, and
what a device name or ``devices=`` means. Nothing is imported here: ``logical.py`` must stay
importable while TensorFlow is half imported (``runtime/tf_import.py``).
"""

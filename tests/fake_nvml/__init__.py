"""A fake NVML for tests; see pynvml.py."""

"""Scripts run unchanged on DeepSpeed and on zfunc (`tests/test_huggingface.py`)."""

import os

# Forked test workers run matmuls; a threaded OpenMP pool in a forked child can hang.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

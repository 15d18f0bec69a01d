"""Real frameworks (HF accelerate, PyTorch Lightning and Fabric) driving the drop-in: see run.py."""

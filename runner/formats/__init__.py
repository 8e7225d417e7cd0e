"""What defines a file or folder the runner writes or reads (torch-free)."""

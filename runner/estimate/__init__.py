"""What models a run before it starts: FLOPs, memory, communication, pipeline, plan, predictor (torch-free)."""

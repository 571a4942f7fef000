"""Models: each declares its parameter count and FLOPs per token for the plan and MFU."""

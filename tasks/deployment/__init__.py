"""What a deployment is: the run form (config) and how it becomes each stage's settings (stages)."""

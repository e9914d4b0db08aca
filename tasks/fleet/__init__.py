"""A fleet of GPU hosts: their list (deployments/hosts.yaml), and a rollout over them, canary first."""

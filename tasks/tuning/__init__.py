"""The search for the best serving configuration: candidates, pruning, results, the winner."""

"""Scoring math answers: answer extraction, the math-verify worker pool, the training rewards, and the rules of
verl's `math_dapo`, `math_reward` and `prime_math` scorers (docs/architecture.md)."""

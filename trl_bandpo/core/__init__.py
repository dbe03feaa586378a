"""The math of the package, torch only: the Band operator and its solvers, the policy-loss registry and the losses,
the count metrics, and the checks every setting goes through (docs/architecture.md)."""

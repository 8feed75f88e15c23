"""Every figure, drawn with seaborn from saved tidy tables; sits low because every wing above draws."""

__all__ = ["choices", "plots", "viewer"]

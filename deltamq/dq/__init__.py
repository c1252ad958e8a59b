"""Data-quality checks over the warehouse tables."""

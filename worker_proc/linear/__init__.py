"""Linear products: `GemmSite`, the one object each matrix product goes through, and the methods it runs."""

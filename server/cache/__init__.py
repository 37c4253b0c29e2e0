"""What the server does for the prefix cache: breakpoints, salts per tenant, named caches, sessions, the normalisations that keep a prompt's prefix stable, why a token missed, per-tenant budgets."""

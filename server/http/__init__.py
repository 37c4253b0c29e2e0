"""HTTP plumbing: the app and its routes, bodies and SSE, connection and request limits, graceful shutdown, metrics, the OpenAPI schema."""

"""What the tests and the benchmarks share: the stub upstream, a throwaway PostgreSQL, running
proxies and stores, the load generator, harness sessions and hand-built records."""

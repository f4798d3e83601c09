"""What the tests share: the stub upstream, a throwaway PostgreSQL, running proxies and
stores, the load generator and hand-built records. No test imports another test module."""

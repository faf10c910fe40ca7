"""The embedded inference engine: SGLang's HTTP protocol over a continuous-batching CPU/GPU core."""

"""The HTP target: static QDQ per graph, calibration through the float bundle, per-graph precisions, the
lookahead verify graph, the lm head as its own graph, block-wise int4, QNN context binaries."""

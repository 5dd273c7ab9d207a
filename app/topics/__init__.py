"""One module per thing the app explains, each holding that topic's data shaping (numpy / pandas
cut from a Trace, no Streamlit, testable on its own) and its plotly figures. Figure functions end in
``_figure``; positions after a query (the future) come back as NaN, never as -inf.

Shared: tokens (how a token is shown), arrays (a block's site as numpy), figures (the common look).
"""

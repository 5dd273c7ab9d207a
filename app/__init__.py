"""The Streamlit explorer: ``streamlit run app/main.py``. main.py routes; views/ holds one module per
page; state.py the model, the trace store and the session; cards.py the component cards (content in
assets/cards/); shaping.py cuts arrays from a trace; plots.py draws them; widgets.py the shared pieces."""

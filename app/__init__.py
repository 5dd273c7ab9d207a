"""The Streamlit explorer: ``streamlit run app/main.py``, organised by feature.

core/     what every page stands on: settings (environment), models (the model cache), traces (the
          trace store and TraceKey), session (one browser session, View, the schema of its keys),
          keys (how a page declares its keys and URL fields), links (the URL), pages (the page
          list), errors
topics/   one module per topic, its data shaping (no Streamlit) and its figures together: model_map,
          residual, predictions, attention, router, experts, interventions, export, cards (content)
          and card_plots (each card's live plot); tokens, arrays, figures and margins are shared by
          them. intervention_runs, attribution_runs and patching_runs run those pages' analyses on an
          AppModel. Each page's session keys (KEYS) are declared in its topic.
ui/       the Streamlit pieces pages share: widgets (the prologue of a page included), card_view (the
          component cards), comparison (two runs side by side), intervention_controls, causal (the
          attribution's causal check), prefetch (the browser fetches plotly.js while torch loads)
views/    the pages, which only lay out widgets (app.core.pages lists them; no page imports another)
main.py routes; sidebar.py draws the sidebar; plots.py draws the app's figures outside it (a notebook).
"""

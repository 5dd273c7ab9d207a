"""What the pages draw with: Streamlit widgets, the component cards, a comparison of two runs, the
cards' plots by name. The pages (app/views) lay these out; app.topics computes what they show."""
